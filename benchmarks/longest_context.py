"""The longest context that fits in a GPU's memory at micro-batch 1, by the estimate.

  python benchmarks/longest_context.py --model llama3-8b --fit 24 [--world 1]

For each setting --fit tries (FIT_TIERS), the longest --seq_len whose predicted peak fits in
--fit GiB per GPU and whose host memory fits in what this machine has available, found by
bisection (the estimate grows with the sequence length). A prediction, as --estimate's is.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import qlora_fsdp as qf  # noqa: E402


def longest(plan, world, config, budget):
    """The longest --seq_len at which `plan` fits (0: none)."""
    lo, hi = 0, 1 << 24
    while lo < hi:
        mid = (lo + hi + 1) // 2
        trial = argparse.Namespace(**vars(plan))
        trial.seq_len = mid
        if qf.check_plan(trial, world, config, budget).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", choices=list(qf.CONFIGS))
    p.add_argument("--fit", type=float, default=24.0, metavar="GIB", help="memory per GPU")
    p.add_argument("--world", type=int, default=1, help="ranks the model is sharded over")
    p.add_argument("--no_host_limit", action="store_true", help="host memory is no limit")
    mine = p.parse_args()
    args = qf.parse_args(["--model", mine.model, "--batch_size", "1", "--device", "cuda"])
    config = qf.CONFIGS[mine.model]
    host = float("inf") if mine.no_host_limit else (qf.host_available() or float("inf"))
    budget = qf.FitBudget(mine.fit * qf.GiB, host)
    where = "no host limit" if host == float("inf") else f"{host / qf.GiB:.1f} GiB of host memory"
    print(f"{mine.model}, world {mine.world}, {mine.fit:.1f} GiB per GPU, {where}:")
    best = (0, None)
    for plan in qf.fit_plans(args, rows=1):
        tokens = longest(plan, mine.world, config, budget)
        print(f"  {qf.plan_name(plan):<72} {tokens:>10,} tokens")
        best = max(best, (tokens, qf.plan_name(plan)), key=lambda b: b[0])
    allowed = config.max_position_embeddings
    print(f"longest: {best[0]:,} tokens ({best[1]}); the model allows {allowed:,}")


if __name__ == "__main__":
    main()
