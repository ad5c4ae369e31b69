#!/usr/bin/env bash
# bash run.sh         train under torchrun, 2 processes: on 2+ GPUs the talk's benchmark
#                     (Llama-2-7B shape, QLoRA, batch 8/GPU, context 2048, dummy data),
#                     on a CPU-only machine the tiny model on this repo's own bytes over gloo.
# Environment overrides: NPROC MODEL BATCH SEQ STEPS DATA, and EXTRA for any other flags
#   e.g. MODEL=llama2-13b STEPS=5 EXTRA="--cpu_offload" bash run.sh
# bash run.sh bench   speed of the pieces against their references (NF4 dequantization vs a plain
#                     copy and bitsandbytes if installed, AdamW vs torch.optim.AdamW over DTensor),
#                     then a training step of the tiny model on 2 processes, and of the small
#                     model against fully_shard + torchao if torchao is installed.
set -euo pipefail
cd "$(dirname "$0")"
python -c "import torch, numpy" 2>/dev/null || python -m pip install -q -r requirements.txt

if [ "${1:-}" = "bench" ]; then
  python qlora_fsdp.py --bench
  run2() { OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 "$@" 2>/dev/null | tail -1; }
  echo "training step, tiny model, 2 ranks, batch 8 x 128 tokens, compiled:"
  echo "  $(run2 qlora_fsdp.py --model tiny --batch_size 8 --seq_len 128 --steps 12 --log_every 100 --compile)"
  # A training step of the `small` model (256 wide: shapes torchao's NF4 can shard) on 2 ranks,
  # ours, then -- if torchao is installed (never a dependency) -- the same model, batch, context,
  # LoRA and checkpointing under PyTorch's fully_shard with torchao's NF4Tensor. Twice: batch 8,
  # where the model's own matmuls and attention (the same code in both) take most of the step,
  # and batch 1, where the weights' all-gathers and dequantization -- what the stacks differ
  # in -- weigh as they do for a large model at a small batch.
  has_torchao=$(python -c "import torchao.quantization" 2>/dev/null && echo 1 || echo "")
  [ -n "$has_torchao" ] || echo "(torchao not installed: fully_shard + torchao not measured)"
  peer=$(mktemp --suffix .py)
  trap 'rm -f "$peer"' EXIT
  cat > "$peer" <<'PY'
import json, os, sys, time, types
import numpy as np, torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4
sys.path.insert(0, os.environ["REPO"])
import qlora_fsdp as qf
def forward(self, x):  # LoRALinear.forward with torchao's NF4 linear
    lora = F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
    return linear_nf4(x, self.weight) + self.scaling * lora
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
args = qf.parse_args(sys.argv[1:])
qf.COMPILE = args.compile
config = qf.CONFIGS[args.model]
torch.manual_seed(args.seed)
model = qf.Llama(config, torch.bfloat16, args.lora_rank, args.lora_alpha)
for m in model.modules():
    if isinstance(m, qf.NF4Linear):
        m.weight = torch.nn.Parameter(to_nf4(m.weight.dequantize(torch.bfloat16)), requires_grad=False)
        if isinstance(m, qf.LoRALinear):
            m.forward = types.MethodType(forward, m)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
if args.compile:  # torchtune's compile=True: each block compiled
    for layer in model.model.layers:
        layer.compile()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
data = qf.load_tokens(qf.__file__, config.vocab_size, args.seq_len)
times = []
for step in range(args.steps):
    t0 = time.perf_counter()
    x, y = qf.get_batch(data, step, 0, args, world, rank, config.vocab_size)
    loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], args.grad_clip)
    opt.step()
    opt.zero_grad()
    dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
    times.append(time.perf_counter() - t0)
if rank == 0:
    print(json.dumps({"peer": "fully_shard + torchao NF4", "step_ms": round(float(np.median(times[1:])) * 1000, 2)}))
dist.destroy_process_group()
PY
  for batch in 8 1; do
    step=(--model small --batch_size "$batch" --seq_len 128 --steps 12 --log_every 100)
    ours=$(run2 qlora_fsdp.py "${step[@]}" --compile)
    ours_eager=$(run2 qlora_fsdp.py "${step[@]}" --no-compile)
    echo "training step, small model, 2 ranks, batch $batch x 128 tokens:"
    echo "  ours, compiled:                        $ours"
    echo "  ours, eager:                           $ours_eager"
    [ -n "$has_torchao" ] || continue
    theirs=$(REPO="$PWD" run2 "$peer" "${step[@]}" --compile)
    theirs_eager=$(REPO="$PWD" run2 "$peer" "${step[@]}" --no-compile)
    echo "  fully_shard + torchao, compiled blocks: $theirs"
    echo "  fully_shard + torchao, eager:           $theirs_eager"
    python - "$batch" "$ours" "$ours_eager" "$theirs" "$theirs_eager" <<'PY'
import json, sys
ours, ours_eager, theirs, theirs_eager = (json.loads(a)["step_ms"] for a in sys.argv[2:])
best_ours, best_theirs = min(ours, ours_eager), min(theirs, theirs_eager)
print(f"  => batch {sys.argv[1]}: ours {best_ours:.1f} ms vs fully_shard + torchao {best_theirs:.1f} ms "
      f"(the faster of eager and compiled, each): {best_theirs / best_ours:.2f}x")
PY
  done
  exit
fi

gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 1 ]; then
  : "${MODEL:=llama2-7b}" "${BATCH:=8}" "${SEQ:=2048}" "${STEPS:=10}" "${DATA:=dummy}"
  : "${NPROC:=$(( gpus < 2 ? gpus : 2 ))}"
else
  : "${MODEL:=tiny}" "${BATCH:=8}" "${SEQ:=128}" "${STEPS:=200}" "${DATA:=}"
  : "${NPROC:=2}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # 2 processes share the cores
fi
args=(--model "$MODEL" --batch_size "$BATCH" --seq_len "$SEQ" --steps "$STEPS")
[ -n "$DATA" ] && args+=(--data "$DATA")
[ "$STEPS" -gt 50 ] && args+=(--log_every 10)
exec python -m torch.distributed.run --standalone --nproc_per_node "$NPROC" qlora_fsdp.py "${args[@]}" ${EXTRA:-}
