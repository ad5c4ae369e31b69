"""Tiles (--tile_tokens): a step's memory and time with a block's position-wise work in tiles
against the whole piece, in one run.

  python benchmarks/bench_tiles.py                          # 16k tokens, the 512-wide model
  python benchmarks/bench_tiles.py --seq_len 4096 --tile_tokens 512 --no-compile

Each setting is a process of its own (one thread, CPU, world 1), one row of --seq_len tokens,
activation checkpointing: without tiles, then with --tile_tokens K. It measures the bytes its
allocator holds at the peak of a step's forward and backward (the profiler's allocator events,
after a first step has compiled and made the first-time allocations), against what --estimate
predicts for those flags (the activation rows and the all-gather buffers: the state between
steps is apart from the step), then times --steps whole steps (forward, backward, AdamW). It
prints the table and the ratios of tiles to none.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

from bench_context import MEM, allocated_peak
import qlora_fsdp as qf  # noqa: E402


def worker(mine):
    torch.set_num_threads(1)
    qf.CONFIGS["mem"] = MEM
    flags = ["--model", "mem", "--device", "cpu", "--dtype", mine.dtype, "--batch_size", "1"]
    flags += ["--seq_len", str(mine.seq_len), "--tile_tokens", str(mine.tiles)]
    flags += ["--compile" if mine.compile else "--no-compile", "--steps", str(mine.steps + 1)]
    args = qf.parse_args(flags)
    qf.COMPILE = args.compile
    plan = qf.Plan.of(args, 1)
    device = torch.device("cpu")
    model, fsdp = qf.build(MEM, plan, device)
    optimizer = qf.AdamW(fsdp.parameters(), lr=1e-4)
    batches = qf.step_batches(None, 0, plan, 1, 0, MEM.vocab_size)
    b = batches[0]

    def forward_backward():
        model(b.inputs, b.targets, "sum").backward()

    forward_backward()  # compiles, and makes the first-time allocations
    optimizer.zero_grad(set_to_none=True)
    _, peak = allocated_peak(forward_backward)
    optimizer.zero_grad(set_to_none=True)
    est = qf.estimate_memory(MEM, plan)
    seconds = []
    for step in range(mine.steps):
        t0 = time.perf_counter()
        qf.run_step(model, fsdp, optimizer, batches, args, device, step)
        seconds.append(time.perf_counter() - t0)
    result = dict(tiles=mine.tiles, measured=peak, predicted=est.activation_peak + est.gathers)
    print(json.dumps(dict(result, step_s=float(np.median(seconds)))), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq_len", type=int, default=16384)
    p.add_argument("--tile_tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2, help="steps timed after the measured one")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tiles", type=int, help=argparse.SUPPRESS)  # a worker's
    mine = p.parse_args()
    if mine.tiles is not None:
        return worker(mine)
    rows = []
    for tiles in (0, mine.tile_tokens):
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--tiles", str(tiles)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if run.returncode:
            sys.exit(f"--tile_tokens {tiles} failed:\n{run.stderr[-3000:]}")
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    MiB = 2**20
    print(f"MEM (512 wide, 4 layers), one row of {mine.seq_len:,} tokens, {mine.dtype}, "
          f"compile {mine.compile}, checkpointing:")
    print(f"  {'--tile_tokens':>13} {'measured MiB':>13} {'predicted MiB':>14} {'pred/meas':>9} "
          f"{'step s':>8}")
    for r in rows:
        print(f"  {r['tiles']:>13} {r['measured'] / MiB:>13.1f} {r['predicted'] / MiB:>14.1f} "
              f"{r['predicted'] / r['measured']:>9.3f} {r['step_s']:>8.2f}")
    whole, tiled = rows
    print(f"tiles / none: memory {tiled['measured'] / whole['measured']:.3f} measured, "
          f"{tiled['predicted'] / whole['predicted']:.3f} predicted; step time "
          f"{tiled['step_s'] / whole['step_s']:.3f}")


if __name__ == "__main__":
    main()
