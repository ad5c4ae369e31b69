#!/usr/bin/env bash
# bash run.sh         train under torchrun, 2 processes: on 2+ GPUs the talk's benchmark
#                     (Llama-2-7B shape, QLoRA, batch 8/GPU, context 2048, dummy data),
#                     on a CPU-only machine the tiny model on this repo's own bytes over gloo.
# Environment overrides: NPROC MODEL BATCH SEQ STEPS DATA, and EXTRA for any other flags
#   e.g. MODEL=llama2-13b STEPS=5 EXTRA="--cpu_offload" bash run.sh
# bash run.sh bench   speed of the pieces against their references (NF4 dequantization vs a plain
#                     copy and bitsandbytes if installed, AdamW vs torch.optim.AdamW over DTensor),
#                     then a training step of the tiny model on 2 processes.
set -euo pipefail
cd "$(dirname "$0")"
python -c "import torch, numpy" 2>/dev/null || python -m pip install -q -r requirements.txt

if [ "${1:-}" = "bench" ]; then
  python qlora_fsdp.py --bench
  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 qlora_fsdp.py \
    --model tiny --batch_size 8 --seq_len 128 --steps 30 --log_every 10
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
