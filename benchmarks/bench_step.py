"""The floor of a training step, and where the time above it goes.

  python benchmarks/bench_step.py                     # every shape below
  python benchmarks/bench_step.py --shapes small-1x128 --steps 8

The floor is the step's unavoidable dense work, timed alone in the same run with plain ops in the
step's dtype on one thread per rank, both ranks at once, as the step runs them. Per block: the 7
projections' forward matmuls (twice under activation checkpointing: forward and recompute) and
their input-gradient matmuls (the base is frozen: no weight gradients; the first block's q, k, v
need none either, its input being the frozen embedding's output); causal
scaled_dot_product_attention forward (twice under checkpointing) and its backward; then the
lm_head's forward matmul and its input gradient. Everything above it is overhead: LoRA's small
matmuls, norms, RoPE, casts, dequantization, the loss, hooks, copies, waits, the optimizer.

Each shape is one `qlora_fsdp.main` run under torchrun (2 gloo ranks x 1 thread, --device cpu:
the shapes are defined on CPU ranks), which also times the floor before and after training (the
median of all repetitions) and reads rank 0's --profile trace for the breakdown
(benchmarks/profile_breakdown.py). One line per shape: step (median), floor, floor/step, and each
category of the profiled steps in ms per step and % of the profiled step.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _common import BENCH, torchrun
import qlora_fsdp as qf  # noqa: E402
from profile_breakdown import CATEGORIES, breakdown

# name -> (config, per-rank batch, context). Configs not in qf.CONFIGS are added to it in the
# worker process, under the name "bench-" + shape name.
SHAPES = {
    "512-wide": (qf.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=8), 4, 256),
    "small-8x128": ("small", 8, 128),
    "small-1x128": ("small", 1, 128),
}
RANKS = 2


def documents_file(shape, folder):
    """Documents of lengths drawn like an instruction set's (median a quarter of the context, a long
    tail), random ids, each ending with the vocabulary's last id as its EOS: a .npy in folder."""
    config, _, seq = SHAPES[shape]
    vocab = (qf.CONFIGS[config] if isinstance(config, str) else config).vocab_size
    rng = np.random.default_rng(0)
    ids = []
    while len(ids) < 200_000:
        n = int(min(4 * seq, max(2, rng.lognormal(np.log(seq / 4), 0.9))))
        ids += rng.integers(0, vocab - 1, n - 1).tolist() + [vocab - 1]
    path = os.path.join(folder, "docs.npy")
    np.save(path, np.array(ids, dtype=np.uint16 if vocab <= 65536 else np.uint32))
    return path


def config_name(shape):
    config = SHAPES[shape][0]
    return config if isinstance(config, str) else f"bench-{shape}"


# ---- the floor -----------------------------------------------------------------------------------

def floor_ops(c, B, T, checkpointing, dtype):
    """[(category, calls per step, fn, flops per call)]: the step's unavoidable dense work, as plain ops."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)

    L, BT, hd = c.num_hidden_layers, B * T, c.head_dim
    h, kv, d, f = c.num_attention_heads, c.num_key_value_heads, c.hidden_size, c.intermediate_size
    passes = 2 if checkpointing else 1  # forward, and again in backward when checkpointed
    ops = []
    projections = {"q_proj": (d, h * hd), "k_proj": (d, kv * hd), "v_proj": (d, kv * hd),
                   "o_proj": (h * hd, d), "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    for name, (n_in, n_out) in projections.items():
        w, x, grad_y = rand(n_out, n_in), rand(BT, n_in), rand(BT, n_out)
        flops = 2 * BT * n_in * n_out
        ops.append(("matmul", passes * L, lambda x=x, w=w: F.linear(x, w), flops))  # (BT, in) -> (BT, out)
        input_grads = L - 1 if name in ("q_proj", "k_proj", "v_proj") else L
        ops.append(("matmul", input_grads, lambda g=grad_y, w=w: g @ w, flops))  # (BT, out) -> (BT, in)
    q, k, v = rand(B, h, T, hd, grad=True), rand(B, kv, T, hd, grad=True), rand(B, kv, T, hd, grad=True)

    def attention():  # (B, h, T, hd), grouped-query when kv < h
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h)
    y = attention()
    grad_att = torch.randn_like(y)
    ops.append(("attention", passes * L, attention, None))
    ops.append(("attention", L, lambda: torch.autograd.grad(y, (q, k, v), grad_att, retain_graph=True), None))
    w_head, x_head, grad_logits = rand(c.vocab_size, d), rand(BT, d), rand(BT, c.vocab_size)
    flops = 2 * BT * d * c.vocab_size
    ops.append(("matmul", 1, lambda: F.linear(x_head, w_head), flops))  # logits (BT, vocab)
    ops.append(("matmul", 1, lambda: grad_logits @ w_head, flops))  # their gradient -> (BT, d)
    return ops


def time_floor(ops, reps):
    """[(total ms, {category: ms})] for `reps` passes over every op, each called as often as
    one step calls it."""
    out = []
    for _ in range(reps):
        per = {}
        for cat, calls, fn, _ in ops:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per[cat] = per.get(cat, 0.0) + (time.perf_counter() - t0) * 1000
        out.append((sum(per.values()), per))
    return out


# ---- one shape, inside torchrun ------------------------------------------------------------------

class _ProfileWithShapes(torch.profiler.profile):
    """--profile's profiler, asked for operand shapes too: they tell LoRA's rank-r matmuls from
    the base projections'."""

    def __init__(self, *args, **kwargs):
        kwargs["record_shapes"] = True
        super().__init__(*args, **kwargs)


def worker(args):
    torch.set_num_threads(1)
    config, batch, seq = SHAPES[args.worker]
    name = config_name(args.worker)
    if not isinstance(config, str):
        qf.CONFIGS[name] = config
    data = ["--data", args.docs, "--pack", "--eos_id", str(qf.CONFIGS[name].vocab_size - 1)] if args.docs else \
        ["--data", "dummy"]
    train_argv = ["--model", name, "--batch_size", str(batch), "--seq_len", str(seq), "--steps", str(args.steps),
                  "--lora_rank", str(args.lora_rank), "--dtype", "bf16", *data, "--device", "cpu",
                  "--log_every", "1000", "--profile", args.profile,
                  "--checkpointing" if args.checkpointing else "--no-checkpointing",
                  "--compile" if args.compile else "--no-compile"]
    train_args = qf.parse_args(train_argv)
    ops = floor_ops(qf.CONFIGS[name], batch, seq, train_args.checkpointing, torch.bfloat16)
    dist.init_process_group("gloo")  # main() takes it over, and destroys it at the end
    rank = dist.get_rank()
    time_floor(ops, 1)  # warm: first-touch allocation
    dist.barrier()  # the ranks time their floors side by side, as they run the step
    reps = time_floor(ops, args.reps)
    torch.profiler.profile = _ProfileWithShapes
    summary = qf.main(train_argv)
    reps += time_floor(ops, args.reps)  # before and after: drift in the machine's load evens out
    if rank != 0:
        return
    with open(os.path.join(args.profile, "trace_rank0.json")) as f:
        b = breakdown(json.load(f), args.lora_rank)
    floor = float(np.median([total for total, _ in reps]))
    parts = {cat: round(float(np.median([per[cat] for _, per in reps])), 2) for cat in reps[0][1]}
    matmul_flops = sum(calls * flops for cat, calls, _, flops in ops if cat == "matmul")
    print(json.dumps(dict(shape=args.worker, model=name, packed=bool(args.docs), world_size=summary["world_size"], batch_size=batch,
                          seq_len=seq, checkpointing=train_args.checkpointing, step_ms=summary["step_ms"],
                          floor_ms=round(floor, 2), floor_parts_ms=parts,
                          floor_matmul_gflops=round(matmul_flops / parts["matmul"] / 1e6, 1),
                          floor_over_step=round(floor / summary["step_ms"], 3),
                          profiled_step_ms=round(b["step_ms"], 2), profiled_steps=b["steps"],
                          has_shapes=b["has_shapes"], breakdown_ms={k: round(v, 2) for k, v in b["ms"].items()},
                          summary=summary)), flush=True)


# ---- the driver ------------------------------------------------------------------------------------

def describe(shape):
    config, batch, seq = SHAPES[shape]
    c = qf.CONFIGS[config] if isinstance(config, str) else config
    gqa = f"/{c.num_key_value_heads} kv" if c.num_key_value_heads != c.num_attention_heads else ""
    return (f"{shape}: d {c.hidden_size}, ffn {c.intermediate_size}, {c.num_attention_heads}{gqa} heads, "
            f"{c.num_hidden_layers} blocks, vocab {c.vocab_size}, {batch} x {seq} per rank")


def line(r):
    b, step = r["breakdown_ms"], r["profiled_step_ms"]
    parts = " + ".join(f"{k} {v:.1f}" for k, v in r["floor_parts_ms"].items())
    cats = ", ".join(f"{c} {b[c]:.1f} ({100 * b[c] / step:.0f}%)" for c in CATEGORIES)
    return (f"{r['shape']:<12} step {r['step_ms']:7.1f} ms | floor {r['floor_ms']:7.1f} ms ({parts}; its matmuls at "
            f"{r['floor_matmul_gflops']:.0f} GFLOP/s a rank) | "
            f"floor/step {r['floor_over_step']:.2f} | profiled step {step:.1f} ms: {cats}")


def overheads(r):
    """Time above the floor by category, largest first: matmul and attention less their floors."""
    b = dict(r["breakdown_ms"])
    for cat, ms in r["floor_parts_ms"].items():
        b[f"{cat} beyond its floor"] = b.pop(cat) - ms
    return sorted(b.items(), key=lambda kv: -kv[1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--steps", type=int, default=12, help="training steps per shape (steps 3-5 are profiled)")
    p.add_argument("--reps", type=int, default=5, help="floor repetitions before and again after training")
    p.add_argument("--lora_rank", type=int, default=8)
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--timeout", type=float, default=900, help="seconds per shape")
    p.add_argument("--pack", nargs="*", default=["512-wide"], choices=list(SHAPES),
                   help="shapes also run on packed documents (--pack), against the same shape unpacked")
    p.add_argument("--worker", choices=list(SHAPES), help=argparse.SUPPRESS)  # one shape, under torchrun
    p.add_argument("--profile", help=argparse.SUPPRESS)
    p.add_argument("--docs", help=argparse.SUPPRESS)  # a documents file: the worker runs --pack
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.steps < 5:
        p.error("--steps must be >= 5: steps 3-5 are the profiled ones")
    print(f"floor of a training step: {RANKS} gloo ranks x 1 thread, bf16, LoRA rank {args.lora_rank} on all 7 "
          f"projections, checkpointing {'on' if args.checkpointing else 'off'}, "
          f"{'compiled' if args.compile else 'eager'}, dummy data; step = median of {args.steps - 1} steps; "
          f"floor = median of {2 * args.reps} timings; breakdown from rank 0's --profile trace, ms per step")
    results, failed = [], 0
    for shape in args.shapes:
        print("  " + describe(shape), flush=True)
    runs = [(shape, False) for shape in args.shapes] + [(shape, True) for shape in args.pack if shape in args.shapes]
    for shape, packed in runs:
        with tempfile.TemporaryDirectory() as prof:
            flags = ["--worker", shape, "--profile", prof, "--steps", args.steps, "--reps", args.reps,
                     "--lora_rank", args.lora_rank, "--checkpointing" if args.checkpointing else "--no-checkpointing",
                     "--compile" if args.compile else "--no-compile"]
            if packed:
                flags += ["--docs", documents_file(shape, prof)]
            run = torchrun(BENCH / "bench_step.py", flags,
                           RANKS, env={"OMP_NUM_THREADS": "1"}, timeout=args.timeout)
        if run.ok and "floor_ms" in run.json:
            results.append(run.json)
            print(("(packed) " if packed else "") + line(run.json), flush=True)
        else:
            failed += 1
            print(f"{shape:<12} FAILED, {run.error() or 'no floor in its output'}", flush=True)
    for r in results:
        plain = next((u for u in results if u["shape"] == r["shape"] and not u["packed"]), None)
        if r["packed"] and plain:
            ratio = r["summary"]["tokens_per_s"] / plain["summary"]["tokens_per_s"]
            print(f"  {r['shape']}: --pack {r['summary']['tokens_per_s']:,.0f} tok/s (rows of whole documents, "
                  f"each attending to itself) vs unpacked {plain['summary']['tokens_per_s']:,.0f}: {ratio:.2f}x")
    for r in results:
        if not r["has_shapes"]:
            print(f"  ({r['shape']}: the trace has no operand shapes, so LoRA's matmuls count as matmul)")
        print(f"  {r['shape']}: above the floor, largest first: "
              + ", ".join(f"{c} {ms:.1f} ms" for c, ms in overheads(r)[:6] if ms > 0))
    print(json.dumps([{k: v for k, v in r.items() if k != "summary"} for r in results]))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
