"""What --dora costs over LoRA: our DoRA step against our LoRA step, and PEFT's DoRA against PEFT's LoRA,
at the shapes of bench_step.py, in one run.

  python benchmarks/bench_dora.py [--shapes 512-wide small-8x128 small-1x128] [--steps 12] [--rounds 2]

Ours: 2 gloo ranks x 1 thread, compiled, checkpointing, bf16, rank 8 on the 7 projections, dummy data
(qlora_fsdp.main under torchrun, as bench_step.py runs it). PEFT's (benchmarks/peer_peft.py): transformers +
PEFT + bitsandbytes' 4-bit NF4 base, one process x 1 thread at the same per-rank batch, checkpointing,
where the three are installed (never dependencies). Each round runs LoRA then DoRA, for ours then for
PEFT's; a ratio is DoRA's median step over LoRA's, in the same round, and the line gives every round's.
"""

import argparse
import importlib.util
import json
import sys

import numpy as np

from _common import BENCH, launch, torchrun
from bench_step import SHAPES, config_name, describe
import qlora_fsdp as qf

RANKS = 2


def worker(args, rest):
    """One of our runs, inside torchrun: the shape's config registered, then main()."""
    config, batch, seq = SHAPES[args.worker]
    name = config_name(args.worker)
    if not isinstance(config, str):
        qf.CONFIGS[name] = config
    argv = ["--model", name, "--batch_size", str(batch), "--seq_len", str(seq), "--data", "dummy",
            "--device", "cpu", "--dtype", "bf16", "--compile", "--checkpointing", "--log_every", "1000", *rest]
    qf.main(argv)


def ours(shape, dora, steps):
    flags = ["--worker", shape, "--steps", steps] + (["--dora"] if dora else [])
    return torchrun(BENCH / "bench_dora.py", flags, RANKS, env={"OMP_NUM_THREADS": "1"}, timeout=900)


def peft(shape, dora, steps):
    cmd = [sys.executable, str(BENCH / "peer_peft.py"), "--shape", shape, "--steps", str(steps)]
    return launch(cmd + (["--dora"] if dora else []), {"OMP_NUM_THREADS": "1"}, 900)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2, help="LoRA then DoRA, this many times per stack")
    p.add_argument("--worker", choices=list(SHAPES), help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    if args.worker:
        return worker(args, ["--steps", str(args.steps)] + rest)
    stacks = {"ours": ours}
    missing = [m for m in ("transformers", "peft", "bitsandbytes") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"PEFT's DoRA: not measured ({', '.join(missing)} not installed)")
    else:
        stacks["PEFT + bitsandbytes"] = peft
    failed = 0
    results = []
    for shape in args.shapes:
        print("  " + describe(shape), flush=True)
        for who, run in stacks.items():
            ratios = []
            for _ in range(args.rounds):
                ms = {}
                for dora in (False, True):
                    r = run(shape, dora, args.steps)
                    if not r.ok:
                        failed += 1
                        print(f"  {who}, {'DoRA' if dora else 'LoRA'}: FAILED, {r.error()}", flush=True)
                        break
                    ms["DoRA" if dora else "LoRA"] = r.json["step_ms"]
                if len(ms) == 2:
                    ratios.append(ms["DoRA"] / ms["LoRA"])
                    print(f"  {shape:<12} {who:<20} LoRA {ms['LoRA']:7.1f} ms, DoRA {ms['DoRA']:7.1f} ms: "
                          f"DoRA / LoRA {ratios[-1]:.3f}", flush=True)
            if ratios:
                results.append(dict(shape=shape, stack=who, ratios=[round(x, 3) for x in ratios],
                                    median=round(float(np.median(ratios)), 3)))
    for r in results:
        print(f"{r['shape']:<12} {r['stack']:<20} DoRA / LoRA {r['median']:.3f} (rounds: "
              f"{', '.join(f'{x:.3f}' for x in r['ratios'])})")
    print(json.dumps(results))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
