"""The GPU run in one go: the talk's numbers first, each row printed the moment it is measured.

  bash run.sh gpu                    (the same as: python benchmarks/gpu_check.py)
  bash run.sh gpu --dry-run          the same plan walked on the CPU, every device call stubbed

Its first line says what the run depends on: torch, CUDA and Triton versions, the GPU, whether a C
compiler and Python's headers are there (Triton builds its kernels with both; without them the 7B
rows run --no-compile and say so) and whether pytest is. Then the plan: each part's budget in
seconds, inside --limit (default 480 s), which binds: each part is killed at its budget, a part
that would get less than --min_part (30 s) is skipped with a row that says so, and nothing runs past the
limit. In this order:
1. The talk's benchmark: Llama-2-7B's shape with a random NF4 base (drawn and quantized on the GPU),
   LoRA rank 8 on all 7 projections, batch 8 x 2048 per GPU, dummy data, activation checkpointing,
   compiled blocks, under torchrun on min(2, GPUs) ranks, 5 steps: plain;
2. the same with --offload_activations;
3. the CUDA tests (`pytest -v -k cuda test_qlora_fsdp.py`) in what is left of the limit; without
   pytest, a row saying they were skipped.
Each training row: the steady state's peak allocated (peak_mem_gib, after step 1, max over ranks)
and reserved (peak_reserved_gib); --estimate's prediction for the same flags at this world size
and, beside it, on 2 x RTX 3090 (the talk's machines); s/step (median, first step left out);
tokens/s (all ranks); compiles and recompiles (the run's JSON: a compiled row with 0 compiles ran
eagerly); the seconds it took and its budget. Under it, the run's JSON line. A run killed at its
budget reports what its step lines measured, marked partial; the tests, killed, name the one
that was running.

The budget of a training run is planned from a prediction: start-up, the first step's compile,
and the steps at the seconds a step the estimate's FLOPs take at half the GPU's bf16 peak, x1.25.
This process never touches CUDA (the device's name comes from nvidia-smi, or a child), so that
compute modes that allow one process per GPU still run the children. Exits non-zero at once where
there is no GPU (unless --dry-run, or --device cpu: the same sequence on gloo ranks, with a small
--model), and at the end if any part failed.
"""

import time

T0 = time.monotonic()  # the limit counts from here: before the imports, which take seconds

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

from _common import REPO, TRAINER, gpus, launch, torchrun  # noqa: E402
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
GRACE_S = 10  # of a part's budget, for its kill: SIGTERM, then SIGKILL after this
TAIL_S = 5  # of the limit, kept for the last lines
MIN_PART_S = 30  # a part that would get less is skipped: it could not measure anything
THE_TALKS = ("NVIDIA GeForce RTX 3090", (8, 6), 2)  # the talk's 2 x 3090 (sm86)
DRY_RUN_GPU = ("NVIDIA H100 80GB HBM3 (dry run: no device is used)", (9, 0), 1)

# The trainer's stand-in for --dry-run, started by torchrun as the trainer is: it parses the
# trainer's flags with the trainer's parser (a flag it no longer takes fails here, not on the GPU),
# then prints the step lines and the JSON line a run prints, with the plan's numbers.
STUB_TRAINER = """
import json, os, sys, time
sys.path.insert(0, os.environ["GPU_CHECK_REPO"])
import qlora_fsdp as qf
args = qf.parse_args(sys.argv[1:])
r = json.loads(os.environ["GPU_CHECK_STUB"])
time.sleep(r.pop("stall"))
for i in range(1, args.steps + 1):
    print(f"step {i}/{args.steps} | loss 10.3700 | lr 1.0e-04 | {r['step_ms']:.0f} ms | "
          f"{r['tokens_per_s']:,.0f} tok/s | mem {r['peak_mem_gib']:.2f} GiB", flush=True)
print(json.dumps(r))
"""
# --dry-run --stall S: each stubbed part first hangs S s, to see the budgets and the limit bind.
STALL = "import os, sys, time; time.sleep(float(sys.argv[1])); os.execv(sys.argv[2], sys.argv[2:])"


def elapsed():
    return time.monotonic() - T0


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


def toolchain():
    """(what the GPU run depends on, for the first line; whether Triton can build kernels here).
    Triton compiles a small C launcher per kernel: a compiler (CC, else gcc, else clang; cc
    too) and Python.h."""
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang") or shutil.which("cc")
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    has_header = os.path.isfile(header)
    pytest = importlib.util.find_spec("pytest") is not None
    said = [f"torch {torch.__version__}", f"CUDA {torch.version.cuda or 'none (a CPU build)'}",
            f"Triton {triton or 'not installed'}", f"C compiler {cc or 'none'}",
            f"Python.h {'yes' if has_header else 'missing (' + header + ')'}",
            f"pytest {'yes' if pytest else 'missing'}"]
    # A CPU build has no Triton and needs none: only a CUDA build's missing pieces matter.
    can_build = bool(cc and has_header and (triton or torch.version.cuda is None))
    return ", ".join(said), can_build, pytest


def estimate(flags, world, capability):
    """--estimate's predicted peak per GPU (GiB) for these flags at this world size, on a GPU of
    this compute capability (its function, in this process: no time out of the budget, and no CUDA
    context)."""
    args = qf.parse_args([str(f) for f in flags])
    plan = qf.Plan.of(args, world)
    return qf.estimate_memory(qf.CONFIGS[args.model], plan, capability).gpu_peak / qf.GiB


def step_flops(config, batch, seq):
    """FLOPs of one training step on one GPU: each projection's matmul forward, recomputed and
    input-gradient (6 N per token; the frozen base has no weight gradient), the head's forward and
    input gradient, causal attention forward, recomputed and backward (twice the forward)."""
    tokens = batch * seq
    linear, head, _, _ = qf.count_params(config)
    q_dim = config.num_attention_heads * config.head_dim
    attention = config.num_hidden_layers * 4 * 2 * seq * q_dim  # per token: 4 passes of QK^T, AV
    return tokens * (6 * linear + 4 * head + attention)


def plan(args, name):
    """(seconds a training run is planned to take, seconds a step is predicted to take, how)."""
    peak = next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)
    if peak is None:
        return args.run_timeout, None, f"--run_timeout: no prediction for {name}"
    step_s = step_flops(qf.CONFIGS[args.model], args.batch_size, args.seq_len) / (peak * ACHIEVED)
    how = (f"{START_S} s to start, {COMPILE_S} s to compile {KERNEL_GRAPHS + BLOCK_GRAPHS} graphs, "
           f"{args.steps} steps at a predicted {step_s:.2f} s ({ACHIEVED:.0%} of the peak), x{MARGIN}")
    return MARGIN * (START_S + COMPILE_S + args.steps * step_s), step_s, how


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


HEADER = ("row", "result", "alloc GiB", "reserved GiB", "predicted", "2x3090 pred.", "s/step",
          "tokens/s", "compiles", "recompiles", "s", "budget s")
WIDTHS = (34, 18, 10, 13, 10, 13, 8, 10, 9, 11, 6, 9)


def table_row(cells):
    return "".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, WIDTHS)))


class Check:
    """The parts run one after another against one clock: each gets min(its plan, what is left of
    the limit), and is killed at that budget."""

    def __init__(self, args):
        self.args = args
        self.errors = []
        self.header_printed = False
        self.step_s = None  # the plan's seconds a step, where the device is known

    def budget(self, planned):
        """A part's seconds: its plan, or what is left of the limit, if less; None: not enough."""
        left = self.args.limit - elapsed() - TAIL_S
        budget = left if planned is None else min(planned, left)
        return budget if budget >= self.args.min_part else None

    def command(self, cmd):
        """cmd as this run starts it: under --dry-run --stall S, after S s of hanging (the stub
        trainer hangs itself)."""
        if self.args.dry_run and self.args.stall:
            return [sys.executable, "-c", STALL, str(self.args.stall), *cmd]
        return cmd

    def print_row(self, cells, lines=()):
        if not self.header_printed:
            print(table_row(HEADER), flush=True)
            self.header_printed = True
        print(table_row(cells).rstrip(), flush=True)
        for line in lines:
            print("    " + line, flush=True)

    def skipped(self, label, planned):
        left = max(0.0, self.args.limit - elapsed() - TAIL_S)
        why = f"skipped: {left:.0f} s left of --limit {self.args.limit:.0f}, under {self.args.min_part:g} s"
        self.errors.append((label, why))
        self.print_row((label, "skipped") + ("",) * 10, [why])

    def train(self, label, flags, world, predicted, talks, planned):
        budget = self.budget(planned)
        if budget is None:
            return self.skipped(label, planned)
        args = self.args
        argv = flags + ["--steps", args.steps, "--log_every", 1, "--device", args.device]
        if args.dry_run:
            # The plan's numbers, as a run would report them.
            step_s = self.step_s or 1.0
            stub = dict(stall=args.stall, model=args.model, world_size=world, steps=args.steps, dry_run=True,
                        step_ms=round(1000 * step_s), tokens_per_s=round(world * args.batch_size * args.seq_len / step_s),
                        peak_mem_gib=round(predicted, 3), peak_reserved_gib=round(predicted, 3),
                        predicted_peak_gib=round(predicted, 3), compiles=KERNEL_GRAPHS + BLOCK_GRAPHS, recompiles=0)
            env = dict(GPU_CHECK_STUB=json.dumps(stub), GPU_CHECK_REPO=str(REPO))
            with tempfile.TemporaryDirectory() as folder:
                trainer = os.path.join(folder, "stub_trainer.py")
                with open(trainer, "w") as f:
                    f.write(STUB_TRAINER)
                run = torchrun(trainer, argv, world, env, timeout=budget - GRACE_S, grace=GRACE_S)
        else:
            run = torchrun(TRAINER, argv, world, timeout=budget - GRACE_S, grace=GRACE_S)
        s = run.json if run.ok else partial(run)
        stub = " (stub)" if args.dry_run else ""
        status = ("ok" + stub) if run.ok else f"partial ({s['steps']} steps)" if s else \
            f"killed ({budget:.0f} s budget)" if run.timed_out else f"FAILED (exit {run.rc})"
        if not run.ok:
            self.errors.append((label, run.error()))
        step = s["step_ms"] / 1000 if "step_ms" in s else None
        numbers = [(s.get("peak_mem_gib"), ".2f"), (s.get("peak_reserved_gib"), ".2f"), (predicted, ".2f"),
                   (talks, ".2f"), (step, ".2f"), (s.get("tokens_per_s"), ",.0f"), (s.get("compiles"), "d"),
                   (s.get("recompiles"), "d"), (run.seconds, ".0f"), (budget, ".0f")]
        said = "json: " + (json.dumps(run.json) if run.json else "none (it did not finish: the numbers are its step lines')")
        self.print_row((label, status) + tuple(fmt(x, spec) for x, spec in numbers), [said])

    def tests(self, has_pytest):
        label = "CUDA tests (pytest -k cuda)"
        if not has_pytest:
            why = f"skipped: pytest is not installed for {sys.executable} (run.sh gpu installs nothing)"
            return self.print_row((label, "skipped") + ("",) * 10, [why])
        budget = self.budget(None)
        if budget is None:
            return self.skipped(label, None)
        # -v: a line per test as it ends, so that a run killed at its budget still tells how far it got.
        # The dry run collects them (their count, and that they import) without running any.
        mode = ["--collect-only", "-q"] if self.args.dry_run else ["-v", "-rfE"]
        cmd = [sys.executable, "-m", "pytest", *mode, "test_qlora_fsdp.py", "-k", "cuda"]
        tests = launch(self.command(cmd), timeout=budget - GRACE_S, grace=GRACE_S)
        out = [line for line in tests.stdout.splitlines() if line.strip()]
        counts = r"\d+ (passed|failed|skipped|deselected|error|tests? collected)"
        summary = next((line.strip("= ") for line in reversed(out) if re.search(counts, line)), None)
        if summary is None and tests.timed_out:
            done = [w for line in out for w in ("PASSED", "FAILED", "SKIPPED", "ERROR") if f" {w}" in line]
            counts = ", ".join(f"{done.count(w)} {w.lower()}" for w in dict.fromkeys(done)) or "no test done"
            running = running_test(tests.stdout)
            summary = f"killed at {budget:.0f} s after {counts}" + (f", in {running}" if running else "")
        if tests.rc != 0 or summary is None or tests.timed_out:
            failed = [line for line in out if line.startswith(("FAILED", "ERROR"))]
            self.errors.append((label, "\n".join(["    " + line for line in failed] or [tests.error()])))
        result = "ok" if tests.rc == 0 and not tests.timed_out else "FAILED" if not tests.timed_out else "killed"
        self.print_row((label, result) + ("",) * 8 + (fmt(tests.seconds, ".0f"), fmt(budget, ".0f")),
                       [summary or "no summary line"])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--batch_size", type=int, default=8, help="per GPU")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--run_timeout", type=float, default=150,
                   help="seconds for each training run where the device's speed is unknown")
    p.add_argument("--limit", type=float, default=480,
                   help="seconds the whole check may take, from its start: binding")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: run the same checks on gloo ranks, to try this script without a GPU "
                        "(with a small --model)")
    p.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                   help="walk the plan on this machine with every device call stubbed: the table's rows with "
                        "their budgets, no training, no CUDA (the tests collected, not run)")
    p.add_argument("--stall", type=float, default=0,
                   help="with --dry-run: each stubbed part hangs this many seconds first (the limit binds)")
    p.add_argument("--min_part", type=float, default=MIN_PART_S, metavar="S",
                   help="a part that would get less than S s is skipped (with --dry-run --stall, a small S "
                        "sees the budgets bind in seconds)")
    args = p.parse_args()
    if args.limit <= TAIL_S + args.min_part:
        p.error(f"--limit {args.limit:g}: at least {TAIL_S + args.min_part:g} s are needed for one part")
    if args.stall and not args.dry_run:
        p.error("--stall is for --dry-run only")
    check = Check(args)
    said, can_build, has_pytest = toolchain()
    if args.dry_run:
        name, capability, n_gpus = DRY_RUN_GPU
    elif args.device == "cuda":
        n_gpus = gpus()  # NVML's count: no CUDA context
        name, capability = device() if n_gpus else ("no GPU", None)
    else:
        name, capability, n_gpus = "CPU (gloo)", None, 0
    print(f"GPU check: {n_gpus} x {name}; {said}", flush=True)
    if args.device == "cuda" and n_gpus == 0 and not args.dry_run:
        print("gpu check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing was run "
              "(--dry-run walks the plan without one)", file=sys.stderr)
        return 2
    world = min(2, n_gpus) if args.device == "cuda" else 2
    flags = ["--model", args.model, "--data", "dummy", "--batch_size", args.batch_size, "--seq_len", args.seq_len]
    if args.device == "cuda" and not can_build:
        flags.append("--no-compile")
        print("gpu check: Triton cannot build kernels here (see the compiler, Python.h and Triton above): the "
              "training rows run --no-compile (eager), and the CUDA tests that compile will fail", flush=True)
    if args.device == "cuda":
        planned, check.step_s, how = plan(args, name)
    else:
        planned, check.step_s, how = args.run_timeout, None, "--run_timeout (--device cpu)"
    rows = [" ".join([args.model] + extra) for extra in ([], ["--offload_activations"])]
    tests_s = args.limit - TAIL_S - 2 * planned - elapsed()
    print(f"plan, inside --limit {args.limit:.0f} s (each part killed at its budget; a part left under "
          f"{args.min_part:g} s is skipped):", flush=True)
    for i, row in enumerate(rows, 1):
        print(f"  {i}. {row:<34} {planned:5.0f} s  ({how})", flush=True)
    print(f"  3. {'CUDA tests (pytest -k cuda)':<34} {max(0, tests_s):5.0f} s  (what is left"
          + (f", under the {args.min_part:g} s a part needs: skipped" if tests_s < args.min_part else "") + ")", flush=True)
    print(f"training rows: world {world}, batch {args.batch_size} x {args.seq_len} per rank, dummy data, "
          f"checkpointing, {'eager' if '--no-compile' in flags else 'compiled'}, {args.steps} steps; "
          f"'predicted' is --estimate's at world {world}, '2x3090 pred.' on the talk's 2 x RTX 3090", flush=True)

    for row, extra in zip(rows, ([], ["--offload_activations"])):
        predicted = estimate(flags + extra, world, capability)
        talks = estimate(flags + extra, THE_TALKS[2], THE_TALKS[1])
        check.train(row, flags + extra, world, predicted, talks, planned)
    check.tests(has_pytest)

    wall = elapsed()
    within = "inside" if wall <= args.limit else "OVER"
    print(f"{'dry run' if args.dry_run else 'all checks'}: {wall:.0f} s of wall time, {within} the "
          f"{args.limit:.0f} s limit", flush=True)
    for label, err in check.errors:
        print(f"\n{label}: {err}")
    if wall > args.limit:
        return 1
    if args.dry_run and args.stall:  # parts killed at their budgets are what --stall asks for
        return 0
    return 1 if check.errors else 0


if __name__ == "__main__":
    sys.exit(main())
