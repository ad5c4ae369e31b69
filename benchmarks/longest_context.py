"""The longest context that fits in a GPU's memory at micro-batch 1, by the estimate.

  python benchmarks/longest_context.py --model llama3-8b --fit 24 [--world 1]
  python benchmarks/longest_context.py --table          # the README's: 1-8 GPUs of 24 and 80 GB

For each setting --fit tries (FIT_TIERS), and each --context_parallel N that divides the world
and the heads, the longest --seq_len (a multiple of N) whose predicted peak fits in --fit GiB per
GPU and whose host memory fits in what this machine has available, found by bisection (the
estimate grows with the sequence length). A prediction, as --estimate's is.
"""

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import qlora_fsdp as qf  # noqa: E402


def longest(plan, world, config, budget):
    """The longest --seq_len, a multiple of plan.context_parallel (and of its tile), at which
    `plan` fits (0: none)."""
    n = plan.context_parallel * (plan.tile_tokens or 1)  # a tile divides a rank's piece
    lo, hi = 0, (1 << 24) // n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        trial = dataclasses.replace(plan, seq_len=mid * n)
        if qf.shortfall(qf.estimate_memory(config, trial), budget) is None:
            lo = mid
        else:
            hi = mid - 1
    return lo * n


def best(model, world, gib, host, say=None):
    """(tokens, plan's name, its host GiB per rank) of the longest context over every plan."""
    config = qf.CONFIGS[model]
    budget = qf.Budget(gib * qf.GiB, host)
    # A long --seq_len: every tile size divides it (longest() then searches the length).
    argv = ["--model", model, "--batch_size", "1", "--device", "cuda", "--seq_len", str(1 << 20)]
    found = (0, "nothing fits", 0.0)
    heads = config.num_attention_heads
    for n in [n for n in range(1, world + 1) if world % n == 0 and heads % n == 0]:
        args = qf.parse_args(argv + ["--context_parallel", str(n)])
        for plan in qf.fit_plans(qf.Plan.of(args, world), rows=1):
            tokens = longest(plan, world, config, budget)
            if say:
                say(f"  {qf.plan_name(plan):<96} {tokens:>10,} tokens")
            if tokens > found[0]:
                plan = dataclasses.replace(plan, seq_len=tokens)
                host_gib = qf.estimate_memory(config, plan).host_state / qf.GiB
                found = (tokens, qf.plan_name(plan), host_gib)
    return found


def table(model):
    """The README's table: 1, 2, 4 and 8 GPUs of 24 and 80 GB, host memory no limit, each GPU's
    budget what --fit alone leaves on it: its memory less FIT_MARGIN (10%)."""
    print(
        f"| GPUs | {model}, 24 GB each | settings | host GiB per GPU | 80 GB each | settings "
        f"| host GiB per GPU |"
    )
    print("|---|---|---|---|---|---|---|")
    for world in (1, 2, 4, 8):
        cells = []
        for gib in (24, 80):
            budget = gib * (1 - qf.FIT_MARGIN)  # a 24 GB card has 24 GiB
            tokens, name, host = best(model, world, budget, float("inf"))
            cells += [f"{tokens:,}", name.replace("micro-batch 1 x 1, ", ""), f"{host:.1f}"]
        print(f"| {world} | " + " | ".join(cells) + " |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", choices=list(qf.CONFIGS))
    p.add_argument("--fit", type=float, default=24.0, metavar="GIB", help="memory per GPU")
    p.add_argument("--world", type=int, default=1, help="ranks the model is sharded over")
    p.add_argument("--no_host_limit", action="store_true", help="host memory is no limit")
    p.add_argument("--table", action="store_true", help="1-8 GPUs of 24 and 80 GB, no host limit")
    mine = p.parse_args()
    if mine.table:
        return table(mine.model)
    host = float("inf") if mine.no_host_limit else (qf.host_available() or float("inf"))
    where = "no host limit" if host == float("inf") else f"{host / qf.GiB:.1f} GiB of host memory"
    print(f"{mine.model}, world {mine.world}, {mine.fit:.1f} GiB per GPU, {where}:")
    tokens, name, _ = best(mine.model, mine.world, mine.fit, host, say=print)
    allowed = qf.CONFIGS[mine.model].max_position_embeddings
    print(f"longest: {tokens:,} tokens ({name}); the model allows {allowed:,}")


if __name__ == "__main__":
    main()
