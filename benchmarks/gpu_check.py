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

Before anything runs, it prints each part's time budget, planned from a prediction: start-up, the
first step's compile, and the steps at the seconds a step the estimate's FLOPs take at the GPU's
peak (half of it achieved), with a margin; and whether the whole fits in --limit seconds. A
training run killed at its budget still reports what its step lines measured, marked partial; the
CUDA tests, killed, name the test that was running. This process never touches CUDA (the device's
name comes from nvidia-smi, or a child), so that compute modes that allow one process per GPU
still run the children. Exits non-zero at once where there is no GPU (unless --device cpu: the
same sequence on gloo ranks, with a small --model), and at the end if any check failed.
"""

import argparse
import re
import statistics
import subprocess
import sys
import time

import torch

from _common import TRAINER, gpus, launch, torchrun
import qlora_fsdp as qf  # noqa: E402

# Dense bf16 tensor-core peaks (FLOP/s), by a piece of the device's name; half is what a step
# achieves at best, and what the plan assumes.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12,
              "L40S": 362e12, "A10G": 125e12, "4090": 165e12, "3090": 71e12, "V100": 125e12}
ACHIEVED = 0.5
START_S = 45  # imports, the process group, drawing and quantizing the base on the GPU
# What compiles before the first step, as qlora_fsdp leaves it (test_one_compile_serves_every_shape
# counts them): one graph per NF4 kernel and for the loss, each serving every shape (quantize,
# dequantize to bf16, the cross entropy's rows), and one for all the blocks, its forward and
# backward. Both ranks compile at once. The seconds are assumed (Inductor with Triton, cold
# cache): no GPU run has measured them yet.
KERNEL_GRAPHS, KERNEL_S = 3, 10
BLOCK_GRAPHS, BLOCK_S = 1, 60
COMPILE_S = KERNEL_GRAPHS * KERNEL_S + BLOCK_GRAPHS * BLOCK_S
MARGIN = 1.25


def device():
    """(name, compute capability) of the first GPU, with no CUDA context in this process: from
    nvidia-smi, else from a child process."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            name, cap = out.stdout.splitlines()[0].rsplit(",", 1)
            major, minor = cap.strip().split(".")
            return name.strip(), (int(major), int(minor))
    except (OSError, subprocess.TimeoutExpired, ValueError):
        pass
    code = "import torch; print(torch.cuda.get_device_name(0)); print(*torch.cuda.get_device_capability(0))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = child.stdout.splitlines()
    if len(lines) == 2:
        return lines[0].strip(), tuple(map(int, lines[1].split()))
    return "an unknown GPU", None


def estimate(flags, world, capability):
    """--estimate's predicted peak per GPU (GiB) for these flags at this world size, on a GPU of
    this compute capability (its function, in this process: no time out of the budget, and no CUDA
    context)."""
    args = qf.parse_args([str(f) for f in flags])
    return qf.predicted_memory(args, world, qf.CONFIGS[args.model], capability).gpu_peak / qf.GiB


def step_flops(config, batch, seq):
    """FLOPs of one training step on one GPU: each projection's matmul forward, recomputed and
    input-gradient (6 N per token; the frozen base has no weight gradient), the head's forward and
    input gradient, causal attention forward, recomputed and backward (twice the forward)."""
    tokens = batch * seq
    linear, head, _, _ = qf.count_params(config)
    q_dim = config.num_attention_heads * config.head_dim
    attention = config.num_hidden_layers * 4 * 2 * seq * q_dim  # per token: 4 passes of QK^T, AV
    return tokens * (6 * linear + 4 * head + attention)


def plan(args, name, world):
    """(seconds each training run is given, seconds a step is predicted to take) on this device."""
    peak = next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)
    if peak is None:
        return args.run_timeout, None
    step_s = step_flops(qf.CONFIGS[args.model], args.batch_size, args.seq_len) / (peak * ACHIEVED)
    return MARGIN * (START_S + COMPILE_S + args.steps * step_s), step_s


def step_lines(stdout):
    """(ms, tokens/s, GiB) of each logged step line, for a run that did not finish."""
    found = re.findall(r"^step \d+/\d+ \| .* \| (\d+) ms \| ([\d,]+) tok/s \| (?:mem|rss) ([\d.]+) GiB",
                       stdout, re.M)
    return [(float(ms), float(tok.replace(",", "")), float(gib)) for ms, tok, gib in found]


def partial(run):
    """What a killed run's step lines measured: {step_ms, tokens_per_s, peak_mem_gib}, or {}."""
    steps = step_lines(run.stdout)
    timed = steps[1:] or steps  # the first compiles
    if not timed:
        return {}
    return dict(step_ms=statistics.median(ms for ms, _, _ in timed),
                tokens_per_s=statistics.median(tok for _, tok, _ in timed),
                peak_mem_gib=max(gib for _, _, gib in timed), steps=len(steps))


def running_test(stdout):
    """The test pytest -v was running when it was killed: its last line without a result."""
    lines = [line for line in stdout.splitlines() if "::" in line]
    if lines and not re.search(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", lines[-1]):
        return lines[-1].split()[0]
    return None


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def run_tests(args, rows, errors):
    # -v: a line per test as it ends, so that a run killed at its budget still tells how far it got
    tests = launch([sys.executable, "-m", "pytest", "-v", "-rfE", "test_qlora_fsdp.py", "-k", "cuda"],
                   timeout=args.test_timeout)
    out = [line for line in tests.stdout.splitlines() if line.strip()]
    summary = next((line.strip("= ") for line in reversed(out) if re.search(r"\d+ (passed|failed|skipped|"
                                                                            r"deselected|error)", line)), None)
    if summary is None and tests.timed_out:
        done = [w for line in out for w in ("PASSED", "FAILED", "SKIPPED", "ERROR") if f" {w}" in line]
        counts = ", ".join(f"{done.count(w)} {w.lower()}" for w in dict.fromkeys(done)) or "no test done"
        running = running_test(tests.stdout)
        summary = f"timed out after {counts}" + (f", in {running}" if running else "")
    if tests.rc != 0 or summary is None or tests.timed_out:
        errors.append(("CUDA tests", "\n".join(["    " + line for line in out if line.startswith(("FAILED", "ERROR"))]
                                               or [tests.error()])))
    rows.append(("CUDA tests (pytest -k cuda)", summary or "FAILED", None, None, None, None, None, tests.seconds))
    print(f"  CUDA tests: {summary or 'FAILED'} ({tests.seconds:.0f} s)", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--batch_size", type=int, default=8, help="per GPU")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--test_timeout", type=float, default=240, help="seconds for the CUDA tests (cold: four compile)")
    p.add_argument("--run_timeout", type=float, default=150,
                   help="seconds for each training run where the device's speed is unknown")
    p.add_argument("--limit", type=float, default=600, help="seconds the whole check should fit in")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: run the same checks on gloo ranks, to try this script without a GPU "
                        "(with a small --model)")
    args = p.parse_args()
    n_gpus = gpus()  # NVML's count: no CUDA context
    if args.device == "cuda" and n_gpus == 0:
        print("gpu check: no CUDA GPU on this machine (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}); nothing was run", file=sys.stderr)
        return 2
    world = min(2, n_gpus) if args.device == "cuda" else 2
    name, capability = device() if args.device == "cuda" else ("CPU (gloo)", None)
    where = f"{n_gpus} x {name}, torch {torch.__version__}, CUDA {torch.version.cuda}" if args.device == "cuda" \
        else f"CPU (gloo), torch {torch.__version__}"
    print(f"GPU check on {where}", flush=True)
    budget, step_s = plan(args, name, world) if args.device == "cuda" else (args.run_timeout, None)
    total = args.test_timeout + 2 * budget
    said = f"predicted {step_s:.2f} s a step ({ACHIEVED:.0%} of {name}'s peak)" if step_s else \
        "no prediction for this device"
    print(f"plan: CUDA tests {args.test_timeout:.0f} s, each training run {budget:.0f} s ({said}; {START_S} s to start, "
          f"{COMPILE_S} s to compile {KERNEL_GRAPHS + BLOCK_GRAPHS} graphs, {args.steps} steps, x{MARGIN}): {total:.0f} s in all", flush=True)
    if total > args.limit:
        print(f"plan: this machine needs {total:.0f} s, more than the {args.limit:.0f} s it has: the last rows may be "
              f"partial", flush=True)
    start = time.perf_counter()

    rows, errors = [], []
    run_tests(args, rows, errors)
    flags = ["--model", args.model, "--data", "dummy", "--batch_size", args.batch_size, "--seq_len", args.seq_len]
    for extra in ([], ["--offload_activations"]):
        label = " ".join([args.model] + extra)
        predicted = estimate(flags + extra, world, capability)
        run = torchrun(TRAINER, flags + extra + ["--steps", args.steps, "--log_every", 1, "--device", args.device],
                       world, timeout=budget)
        s = run.json if run.ok else partial(run)
        status = "ok" if run.ok else f"partial ({s['steps']} steps)" if s else \
            "timed out" if run.timed_out else f"FAILED (exit {run.rc})"
        if not run.ok:
            errors.append((label, run.error()))
        step = s["step_ms"] / 1000 if "step_ms" in s else None
        rows.append((label, status, s.get("peak_mem_gib"), s.get("peak_reserved_gib"), predicted, step,
                     s.get("tokens_per_s"), run.seconds))
        print(f"  {label}: {status} ({run.seconds:.0f} s)", flush=True)

    print(f"\ntraining runs: world {world}, batch {args.batch_size} x {args.seq_len} per rank, dummy data, "
          f"checkpointing, compiled, {args.steps} steps" + (f"; predicted {step_s:.2f} s a step" if step_s else ""))
    header = ("check", "result", "peak alloc GiB", "peak reserved GiB", "predicted GiB", "s/step", "tokens/s", "s")
    widths = (34, 18, 16, 19, 15, 9, 11, 7)

    def table_row(cells):
        return "".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    print(table_row(header))
    for label, status, *numbers, seconds in rows:
        if all(x is None for x in numbers):  # the tests: their summary line is the result
            print(label.ljust(widths[0]) + status + f" ({seconds:.0f} s)")
        else:
            specs = (".2f", ".2f", ".2f", ".2f", ",.0f", ".0f")
            print(table_row((label, status) + tuple(fmt(x, spec) for x, spec in zip(numbers + [seconds], specs))))
    print(f"all checks: {time.perf_counter() - start:.0f} s of wall time")
    for label, err in errors:
        print(f"\n{label}: {err}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
