"""A training step of qlora_fsdp against fully_shard + torchao's NF4 (benchmarks/peer_torchao.py):
the same model, batch, context, LoRA and checkpointing; only the sharding and the NF4 linear differ.

  python benchmarks/bench_vs_torchao.py

The `small` model (256 wide: shapes torchao's NF4 can shard over 2 ranks) twice: at batch 8,
where the model's own matmuls and attention (the same code in both) take most of the step, and
at batch 1, where the weights' all-gathers and dequantization -- what the stacks differ in --
weigh as they do for a large model at a small batch. Each stack runs compiled and eager; the
ratio is between the faster of each. Ranks: 2 gloo x 1 thread on a CPU-only host, else
min(2, GPUs) over NCCL. Measured only where torchao is importable (never a dependency).
"""

import importlib.util
import sys

from _common import BENCH, TRAINER, nproc, torchrun

BATCHES = (8, 1)


def main():
    if importlib.util.find_spec("torchao") is None:
        print("fully_shard + torchao: not measured (torchao is not installed)")
        return 0
    ranks = nproc()
    failed = 0
    for batch in BATCHES:
        flags = ["--model", "small", "--batch_size", batch, "--seq_len", 128, "--steps", 12, "--log_every", 100]
        print(f"training step, small model, {ranks} ranks, batch {batch} x 128 tokens per rank:", flush=True)
        runs = {}
        for who, script in (("ours", TRAINER), ("fully_shard + torchao", BENCH / "peer_torchao.py")):
            for mode in ("--compile", "--no-compile"):
                run = runs[who, mode] = torchrun(script, flags + [mode], ranks, env={"OMP_NUM_THREADS": "1"},
                                                 timeout=600)
                label = f"{who}, {'compiled' if mode == '--compile' else 'eager'}:"
                if run.ok:
                    print(f"  {label:<36} {run.json['step_ms']:8.1f} ms", flush=True)
                else:
                    failed += 1
                    print(f"  {label:<36} FAILED, {run.error()}", flush=True)
        best = {}
        for who in ("ours", "fully_shard + torchao"):
            ms = [r.json["step_ms"] for (w, _), r in runs.items() if w == who and r.ok]
            if ms:
                best[who] = min(ms)
        if len(best) == 2:
            print(f"  => batch {batch}: ours {best['ours']:.1f} ms vs fully_shard + torchao "
                  f"{best['fully_shard + torchao']:.1f} ms (the faster of eager and compiled, each): "
                  f"{best['fully_shard + torchao'] / best['ours']:.2f}x")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
