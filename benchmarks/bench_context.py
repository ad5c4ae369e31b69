"""Long context on 2 ranks: a step's memory and time with each row split (--context_parallel 2)
against whole rows (1), in one run.

  python benchmarks/bench_context.py                      # 16k tokens, the 512-wide model
  python benchmarks/bench_context.py --seq_len 4096 --steps 2

Each setting is one world of 2 ranks under torchrun (gloo, one thread each, CPU), batch 1 per
rank of rows of --seq_len tokens: with N = 1 each rank runs a whole row, with N = 2 the two
ranks hold the halves of one (the memory's comparison); then N = 2 at batch 2, the halves of two
rows: the global batch of N = 1, the same tokens per rank (the time's comparison). A rank measures the bytes its allocator holds at the peak of a
step's forward and backward (the profiler's allocator events, after a first step has made the
first-time allocations), against what --estimate predicts for those flags (the activation
rows and the all-gather buffers: the state between steps is apart from the step). Then it
times --steps whole steps (forward, backward, AdamW). Rank 0 prints the table, and the ratios
of N = 2 to N = 1.
"""

import argparse
import gc
import json
import os
import sys
import time

import numpy as np
import torch

from _common import torchrun
import qlora_fsdp as qf  # noqa: E402

# The 512-wide model of the tests' memory checks: activations outweigh its weights.
MEM = qf.LlamaConfig(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1 << 20,
)


def allocated_peak(fn):
    """(result, the peak of the bytes fn allocates beyond what it started with)."""
    gc.collect()
    gc.disable()
    try:
        with torch.profiler.profile(profile_memory=True) as prof:
            out = fn()
    finally:
        gc.enable()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    total = peak = 0
    for _, n in events:
        total += n
        peak = max(peak, total)
    return out, peak


def worker(mine):
    torch.set_num_threads(1)
    qf.CONFIGS["mem"] = MEM
    flags = ["--model", "mem", "--device", "cpu", "--dtype", mine.dtype]
    flags += ["--batch_size", str(mine.batch_size)]
    flags += ["--seq_len", str(mine.seq_len), "--context_parallel", str(mine.context_parallel)]
    flags += ["--compile" if mine.compile else "--no-compile", "--steps", str(mine.steps + 1)]
    args = qf.parse_args(flags)
    qf.COMPILE = args.compile
    device, world, rank = qf.init_distributed(False)
    plan = qf.Plan.of(args, world)
    model, fsdp = qf.build(MEM, plan, device)
    optimizer = qf.AdamW(fsdp.parameters(), lr=1e-4)
    batches = qf.step_batches(None, 0, plan, world, rank, MEM.vocab_size)
    b = batches[0]

    def forward_backward():
        loss = model(b.inputs, b.targets, "sum", b.positions)
        loss.backward()

    forward_backward()  # compiles, and makes the first-time allocations
    optimizer.zero_grad(set_to_none=True)
    _, peak = allocated_peak(forward_backward)
    optimizer.zero_grad(set_to_none=True)
    est = qf.estimate_memory(MEM, plan)
    predicted = est.activation_peak + est.gathers
    seconds = []
    for step in range(mine.steps):
        t0 = time.perf_counter()
        qf.run_step(model, fsdp, optimizer, batches, args, device, step)
        seconds.append(time.perf_counter() - t0)
    peaks = [None] * world
    torch.distributed.all_gather_object(peaks, peak)
    if rank == 0:
        result = dict(
            context_parallel=args.context_parallel,
            batch_size=args.batch_size,
            tokens_per_rank=b.inputs.numel(),
            measured=max(peaks),
            predicted=predicted,
            step_s=float(np.median(seconds)),
        )
        print(json.dumps(result), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq_len", type=int, default=16384)
    p.add_argument("--steps", type=int, default=2, help="steps timed after the measured one")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--context_parallel", type=int, help=argparse.SUPPRESS)  # a worker's
    p.add_argument("--batch_size", type=int, default=1, help=argparse.SUPPRESS)  # a worker's
    mine = p.parse_args()
    if mine.context_parallel:
        return worker(mine)
    rows = []
    for n, batch in ((1, 1), (2, 1), (2, 2)):
        argv = sys.argv[1:] + ["--context_parallel", str(n), "--batch_size", str(batch)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        run = torchrun(os.path.abspath(__file__), argv, 2, env=env)
        if run.json is None:
            sys.exit(f"N = {n} failed:\n{run.stderr[-3000:]}")
        rows.append(run.json)
    MiB = 2**20
    print(
        f"MEM (512 wide, 4 layers), {mine.seq_len:,}-token rows, 2 ranks, {mine.dtype}, "
        f"compile {mine.compile}:"
    )
    print(
        f"  {'N':>2} {'rows/rank':>9} {'tokens/rank':>12} {'measured MiB':>13} {'predicted MiB':>14} "
        f"{'pred/meas':>9} {'step s':>8}"
    )
    for r in rows:
        print(
            f"  {r['context_parallel']:>2} {r['batch_size']:>9} {r['tokens_per_rank']:>12,} {r['measured'] / MiB:>13.1f} "
            f"{r['predicted'] / MiB:>14.1f} {r['predicted'] / r['measured']:>9.3f} "
            f"{r['step_s']:>8.2f}"
        )
    one, two, same = rows
    print(
        f"N = 2 / N = 1, a row per rank: memory {two['measured'] / one['measured']:.3f} "
        f"measured, {two['predicted'] / one['predicted']:.3f} predicted"
    )
    print(
        f"N = 2 / N = 1, the same global batch and tokens per rank: step time "
        f"{same['step_s'] / one['step_s']:.3f} (the all-to-alls' cost)"
    )


if __name__ == "__main__":
    main()
