"""A training step of qlora_fsdp against its peers, side by side in one run: fully_shard + torchao's
NF4 (benchmarks/peer_torchao.py: our model, batches, LoRA and checkpointing; only the sharding and
the NF4 linear differ) and torchtune's QLoRA recipe (benchmarks/peer_torchtune.py: its own model,
sharding, checkpointing, compile, loss and optimizer) where torchtune is installed.

  python benchmarks/bench_vs_torchao.py [--batches 8 1] [--steps 12]

The `small` model (256 wide: shapes torchao's NF4 can shard over 2 ranks) twice: at batch 8,
where the model's own matmuls and attention take most of the step, and at batch 1, where the
weights' all-gathers and dequantization -- what the stacks differ in -- weigh as they do for a
large model at a small batch. Ours and fully_shard + torchao run compiled and eager; torchtune
compiled and eager, each with torch's foreach and fused AdamW. Each ratio is between the fastest
setting of each stack. Ranks: 2 gloo x 1 thread on a CPU-only host, else min(2, GPUs) over NCCL
(torchtune's peer: CPU ranks only). Measured only where the peers import (never dependencies).
"""

import argparse
import importlib.util
import sys

from _common import BENCH, TRAINER, nproc, torchrun

STACKS = {  # who -> (script, its settings)
    "ours": (TRAINER, (["--compile"], ["--no-compile"])),
    "fully_shard + torchao": (BENCH / "peer_torchao.py", (["--compile"], ["--no-compile"])),
    "torchtune": (BENCH / "peer_torchtune.py",
                  (["--compile"], ["--no-compile"], ["--compile", "--fused"], ["--no-compile", "--fused"])),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 1])
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    if importlib.util.find_spec("torchao") is None:
        print("fully_shard + torchao: not measured (torchao is not installed)")
        return 0
    stacks = dict(STACKS)
    if importlib.util.find_spec("torchtune") is None:
        print("torchtune: not measured (torchtune is not installed)")
        del stacks["torchtune"]
    ranks = nproc()
    failed = 0
    for batch in args.batches:
        flags = ["--model", "small", "--batch_size", batch, "--seq_len", 128, "--steps", args.steps,
                 "--log_every", 100]
        print(f"training step, small model, {ranks} ranks, batch {batch} x 128 tokens per rank:", flush=True)
        best = {}
        for who, (script, settings) in stacks.items():
            for setting in settings:
                run = torchrun(script, flags + setting, ranks, env={"OMP_NUM_THREADS": "1"}, timeout=600)
                label = f"{who}, {' '.join(setting)}:"
                if run.ok:
                    print(f"  {label:<46} {run.json['step_ms']:8.1f} ms", flush=True)
                    best[who] = min(best.get(who, float("inf")), run.json["step_ms"])
                else:
                    failed += 1
                    print(f"  {label:<46} FAILED, {run.error()}", flush=True)
        for who in best:
            if who != "ours" and "ours" in best:
                print(f"  => batch {batch}: ours {best['ours']:.1f} ms vs {who} {best[who]:.1f} ms (the fastest "
                      f"setting of each): ours {best[who] / best['ours']:.2f}x", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
