"""Every GPU check in one go, printed as one table.

  bash run.sh gpu                    (the same as: python benchmarks/gpu_check.py)

1. The CUDA tests: `python -m pytest -q test_qlora_fsdp.py -k cuda` (NF4 and training equal the
   CPU; peak memory within 10% of --estimate), their summary line.
2. The talk's benchmark: Llama-2-7B's shape with a random NF4 base (drawn and quantized on the GPU),
   LoRA rank 8 on all 7 projections, batch 8 x 2048 per GPU, dummy data, activation checkpointing,
   compiled blocks, under torchrun on min(2, GPUs) ranks: plain, and with --offload_activations.
   Columns: the steady state's peak allocated (peak_mem_gib, after step 1, max over ranks) and
   reserved (peak_reserved_gib), --estimate's prediction for the same flags and world size
   (predicted_peak_gib, per GPU), s/step (median, first step left out), tokens/s (all ranks), and
   the seconds the part took (from a cold compile cache: building, compiling, the steps).

A check that fails shows so in its row and its error after the table; the others still run.
The timeouts add up to 6 minutes (the predictions are computed in this process, in no time). Exits
non-zero at once where there is no GPU (unless --device cpu: the same sequence on gloo ranks, with a
small --model), and at the end if any check failed.
"""

import argparse
import re
import sys
import time

import torch

from _common import TRAINER, gpus, launch, torchrun
import qlora_fsdp as qf  # noqa: E402


def estimate(flags, world):
    """--estimate's predicted peak per GPU (GiB) for these flags at this world size (its function, in this process:
    no time out of the budget)."""
    args = qf.parse_args([str(f) for f in flags])
    return qf.predicted_memory(args, world, qf.CONFIGS[args.model]).gpu_peak / qf.GiB


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--batch_size", type=int, default=8, help="per GPU")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--test_timeout", type=float, default=120, help="seconds for the CUDA tests")
    p.add_argument("--run_timeout", type=float, default=120, help="seconds for each training run")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: run the same checks on gloo ranks, to try this script without a GPU "
                        "(with a small --model)")
    args = p.parse_args()
    n_gpus = gpus()
    if args.device == "cuda" and n_gpus == 0:
        print("gpu check: no CUDA GPU on this machine (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}); nothing was run", file=sys.stderr)
        return 2
    world = min(2, n_gpus) if args.device == "cuda" else 2
    where = (f"{n_gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
             if args.device == "cuda" else f"CPU (gloo), torch {torch.__version__}")
    print(f"GPU check on {where}", flush=True)
    start = time.perf_counter()

    rows, errors, failed = [], [], 0
    # -v: a line per test as it ends, so that a run killed at its timeout still tells how far it got
    tests = launch([sys.executable, "-m", "pytest", "-v", "-rfE", "test_qlora_fsdp.py", "-k", "cuda"],
                   timeout=args.test_timeout)
    out = [line for line in tests.stdout.splitlines() if line.strip()]
    summary = next((line.strip("= ") for line in reversed(out) if re.search(r"\d+ (passed|failed|skipped|"
                                                                            r"deselected|error)", line)), None)
    if summary is None and tests.timed_out:
        done = [w for line in out for w in ("PASSED", "FAILED", "SKIPPED", "ERROR") if f" {w}" in line]
        summary = (f"timed out after {', '.join(f'{done.count(w)} {w.lower()}' for w in dict.fromkeys(done))}"
                   if done else None)
    if tests.rc != 0 or summary is None:
        failed += 1
        errors.append(("CUDA tests", "\n".join(["    " + line for line in out if line.startswith(("FAILED", "ERROR"))]
                                               or [tests.error()])))
    rows.append(("CUDA tests (pytest -k cuda)", summary or ("timed out" if tests.timed_out else "FAILED"),
                 None, None, None, None, None, tests.seconds))
    print(f"  CUDA tests: {summary or 'FAILED'} ({tests.seconds:.0f} s)", flush=True)

    flags = ["--model", args.model, "--data", "dummy", "--batch_size", args.batch_size, "--seq_len", args.seq_len]
    for extra in ([], ["--offload_activations"]):
        name = " ".join([args.model] + extra)
        predicted = estimate(flags + extra, world)
        run = torchrun(TRAINER, flags + extra + ["--steps", args.steps, "--log_every", 1, "--device", args.device],
                       world, timeout=args.run_timeout)
        s = run.json if run.ok else {}
        status = "ok" if run.ok else ("timed out" if run.timed_out else f"FAILED (exit {run.rc})")
        if not run.ok:
            failed += 1
            errors.append((name, run.error()))
        step_s = s["step_ms"] / 1000 if "step_ms" in s else None
        rows.append((name, status, s.get("peak_mem_gib"), s.get("peak_reserved_gib"), predicted, step_s,
                     s.get("tokens_per_s"), run.seconds))
        print(f"  {name}: {status} ({run.seconds:.0f} s)", flush=True)

    print(f"\ntraining runs: world {world}, batch {args.batch_size} x {args.seq_len} per rank, dummy data, "
          f"checkpointing, compiled, {args.steps} steps")
    header = ("check", "result", "peak alloc GiB", "peak reserved GiB", "predicted GiB", "s/step", "tokens/s", "s")
    widths = (34, 18, 16, 19, 15, 9, 11, 7)

    def table_row(cells):
        return "".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    print(table_row(header))
    for name, status, *numbers, seconds in rows:
        if all(x is None for x in numbers):  # the tests: their summary line is the result
            print(name.ljust(widths[0]) + status + f" ({seconds:.0f} s)")
        else:
            specs = (".2f", ".2f", ".2f", ".2f", ",.0f", ".0f")
            print(table_row((name, status) + tuple(fmt(x, spec) for x, spec in zip(numbers + [seconds], specs))))
    print(f"all checks: {time.perf_counter() - start:.0f} s of wall time")
    for name, err in errors:
        print(f"\n{name}: {err}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
