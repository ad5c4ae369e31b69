#!/usr/bin/env bash
# bash run.sh         train under torchrun, 2 processes: on 2+ GPUs the talk's benchmark
#                     (Llama-2-7B shape, QLoRA, batch 8/GPU, context 2048, dummy data),
#                     on a CPU-only machine the tiny model on this repo's own bytes over gloo.
#   Environment overrides: NPROC MODEL BATCH SEQ STEPS DATA, EXTRA for other flags, PYTHON
#   e.g. MODEL=llama2-13b STEPS=5 EXTRA="--cpu_offload" bash run.sh
# bash run.sh bench   the benchmarks in benchmarks/ (the pieces against their references,
#                     a step against its floor of dense work, against fully_shard + torchao)
# bash run.sh gpu     every GPU check, each row as it is measured (benchmarks/gpu_check.py;
#                     --dry-run walks its plan on the CPU, --limit S binds its time)
set -euo pipefail
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1  # progress shows as it happens, also through a pipe
# The GPU check installs nothing: a lent GPU machine may be offline, and a failed pip under
# set -e would end the check before it measured anything. It needs torch and numpy; its first
# line says what else it found (CUDA, Triton, a C compiler, Python.h, pytest: without pytest
# the tests are skipped, in a row that says so).
if [ "${1:-}" = gpu ]; then
  for candidate in ${PYTHON:-python3 python}; do
    "$candidate" -c "import torch, numpy" 2>/dev/null && exec "$candidate" benchmarks/gpu_check.py "${@:2}"
  done
  echo "gpu check: no ${PYTHON:-python3 or python} here imports torch and numpy; run.sh gpu" \
    "installs nothing (pip install -r requirements.txt first)" >&2
  exit 2
fi
# Every other mode needs torch, numpy and pytest. PYTHON: by default python3 or python, the
# first that has all three, else python3 once they are installed. One start of it (torch takes
# seconds to import) checks them and counts the GPUs.
check="import torch, numpy, pytest; print(torch.cuda.device_count())"
for candidate in ${PYTHON:-python3 python}; do
  gpus=$("$candidate" -c "$check" 2>/dev/null) && PYTHON=$candidate && break
done
if [ -z "${gpus:-}" ]; then
  : "${PYTHON:=$(command -v python3 || command -v python)}"
  "$PYTHON" -m pip install -q -r requirements.txt
  gpus=$("$PYTHON" -c "$check")
fi
case "${1:-}" in
  bench)  # all of them run; the exit code says if any failed
    status=0
    for script in bench_kernels bench_step bench_vs_torchao; do
      "$PYTHON" "benchmarks/$script.py" || status=1
    done
    exit "$status" ;;
esac
if [ "$gpus" -ge 1 ]; then
  : "${MODEL:=llama2-7b}" "${BATCH:=8}" "${SEQ:=2048}" "${STEPS:=10}" "${DATA:=dummy}"
  : "${NPROC:=$(( gpus < 2 ? gpus : 2 ))}"
else
  : "${MODEL:=tiny}" "${BATCH:=8}" "${SEQ:=128}" "${STEPS:=200}" "${DATA:=}" "${NPROC:=2}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # 2 processes share the cores
fi
args=(--model "$MODEL" --batch_size "$BATCH" --seq_len "$SEQ" --steps "$STEPS")
[ -n "$DATA" ] && args+=(--data "$DATA")
[ "$STEPS" -gt 50 ] && args+=(--log_every 10)
# The tiny model on a CPU: eager (compiling its blocks would take longer than its 200 steps)
[ "$gpus" -eq 0 ] && [ "$MODEL" = tiny ] && args+=(--no-compile --no-checkpointing \
  --sample 160 --prompt "def " --temperature 0.8)
# torchrun through qlora_fsdp.torchrun: a failed rank's report is one line, exit codes passed on
exec "$PYTHON" -c "import qlora_fsdp, sys; qlora_fsdp.torchrun(sys.argv[1:])" --standalone \
  --nproc_per_node "$NPROC" qlora_fsdp.py "${args[@]}" ${EXTRA:-}
