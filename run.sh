#!/usr/bin/env bash
# bash run.sh         train under torchrun, 2 processes: on 2+ GPUs the talk's benchmark
#                     (Llama-2-7B shape, QLoRA, batch 8/GPU, context 2048, dummy data),
#                     on a CPU-only machine the tiny model on this repo's own bytes over gloo.
# Environment overrides: NPROC MODEL BATCH SEQ STEPS DATA, EXTRA for any other flags, PYTHON
#   e.g. MODEL=llama2-13b STEPS=5 EXTRA="--cpu_offload" bash run.sh
# bash run.sh bench   the benchmarks in benchmarks/: NF4 dequantization and AdamW against their
#                     references (bench_kernels.py), a step against its floor of dense work with
#                     the breakdown of the rest (bench_step.py), a step against fully_shard +
#                     torchao if torchao is installed (bench_vs_torchao.py)
# bash run.sh gpu     every GPU check, one table: the CUDA tests, then the talk's 7B benchmark
#                     plain and with --offload_activations (benchmarks/gpu_check.py)
set -euo pipefail
cd "$(dirname "$0")"
# PYTHON: the interpreter to use; by default python3 or python, the first that has torch (else python3 installs it)
if [ -z "${PYTHON:-}" ]; then
  for PYTHON in python3 python ""; do
    [ -n "$PYTHON" ] && "$PYTHON" -c "import torch" 2>/dev/null && break
  done
  : "${PYTHON:=$(command -v python3 || command -v python)}"
fi
# Every mode needs all three (the GPU check runs the tests): install what is missing.
"$PYTHON" -c "import torch, numpy, pytest" 2>/dev/null || "$PYTHON" -m pip install -q -r requirements.txt

case "${1:-}" in
  bench)  # each script prints why a run failed; all of them run, and the exit code says if any failed
    status=0
    export PYTHONUNBUFFERED=1  # progress shows as it happens, also through a pipe
    "$PYTHON" benchmarks/bench_kernels.py || status=1
    "$PYTHON" benchmarks/bench_step.py || status=1
    "$PYTHON" benchmarks/bench_vs_torchao.py || status=1
    exit "$status" ;;
  gpu) exec "$PYTHON" benchmarks/gpu_check.py "${@:2}" ;;
esac

gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
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
[ "$gpus" -eq 0 ] && [ "$MODEL" = tiny ] && args+=(--sample 160 --prompt "def " --temperature 0.8)  # what it learned
# torchrun, with its report of a failed rank cut to one line (the rank has said what went wrong,
# in one line of its own) and Ctrl-C's exit code passed on (the ranks say where they stopped)
launch='import logging, sys
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main
logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the line below says it
try:
    main(sys.argv[1:])
except ChildFailedError as e:
    rank, failure = e.get_first_failure()
    code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    print(f"torchrun: rank {rank} exited with code {code}", file=sys.stderr)
    sys.exit(code)
except SignalException as e:
    sys.exit(128 + e.sigval)'
exec "$PYTHON" -c "$launch" --standalone --nproc_per_node "$NPROC" qlora_fsdp.py "${args[@]}" ${EXTRA:-}
