"""Speed of qlora_fsdp's pieces against their references, every ratio from this one run.

  python benchmarks/bench_kernels.py [--threads N]    # on the GPU if there is one, else on the CPU

1. NF4 dequantization of a 4096 x 11008 weight (Llama-2-7B's MLP) to bf16: eager and compiled,
   against a plain copy of the output bytes (the practical roofline) and bitsandbytes'
   dequantize_4bit where bitsandbytes is installed (never a dependency).
2. One AdamW step over Llama-2-7B's LoRA adapters (rank 8, 7 projections x 32 blocks): ours over
   what qlora_fsdp's FSDP hands it (one flat fp32 shard per block) and over the 448 tensors,
   against torch.optim.AdamW over the DTensors FSDP2 would hand it, and over plain tensors.
"""

import argparse
import json
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from _common import median_ms
import qlora_fsdp as qf  # noqa: E402


def inner_tensors(q):
    """An NF4Tensor's inner tensors (packed codes, scales, ...), as it flattens itself."""
    names, _ = q.__tensor_flatten__()
    return [getattr(q, n) for n in names]


def bench_dequantize(device):
    torch.manual_seed(0)
    w = torch.randn(4096, 11008, dtype=torch.bfloat16, device=device)
    q = qf.to_nf4(w)
    inner = inner_tensors(q)
    n = w.numel()
    moved = sum(t.nbytes for t in inner) / n + w.element_size()  # bytes read + written per element
    # dequantize allocates its output: an allocating copy (clone) is the fair second reference.
    dst = torch.empty_like(w)
    rows = {"copy_ (roofline)": median_ms(lambda: dst.copy_(w)),
            "clone (allocating copy)": median_ms(w.clone),
            "dequantize, eager": median_ms(lambda: qf.dequantize_nf4(*inner, compile=False), 3, 1),
            "dequantize, torch.compile": median_ms(lambda: qf.dequantize_nf4(*inner, compile=True))}
    try:  # a peer, measured only if it is installed
        import bitsandbytes.functional as bnbF
        bq, bstate = bnbF.quantize_4bit(w, quant_type="nf4", blocksize=64, compress_statistics=True)
        rows["bitsandbytes dequantize_4bit"] = median_ms(lambda: bnbF.dequantize_4bit(bq, bstate))
    except Exception as e:  # noqa: BLE001 -- not installed, or no kernel for this device
        print(f"(bitsandbytes not measured: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    roof = rows["copy_ (roofline)"]
    threads = f"{torch.get_num_threads()} threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"NF4 dequantize {tuple(w.shape)} -> bf16 on {device} ({threads}); {moved:.3f} B moved per element:")
    for k, ms in rows.items():
        print(f"  {k:<30} {ms:8.2f} ms  {n / ms / 1e6:7.2f} G elem/s  {n * moved / ms / 1e6:8.2f} GB/s  "
              f"{100 * roof / ms:6.1f}% of copy_")
    results = {"dequantize_ms": {k: round(v, 3) for k, v in rows.items()},
               "compiled_vs_eager_speed": round(rows["dequantize, eager"] / rows["dequantize, torch.compile"], 3)}
    if "bitsandbytes dequantize_4bit" in rows:
        ratio = rows["bitsandbytes dequantize_4bit"] / rows["dequantize, torch.compile"]
        results["compiled_vs_bitsandbytes_speed"] = round(ratio, 3)
        print(f"  => compiled dequantize at {ratio:.2f}x the speed of bitsandbytes'")
    return results


def adapter_shapes(c, rank=8):
    """(rank, in) and (out, rank) of every adapter, block by block, projection by projection."""
    d, f, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * c.head_dim
    projections = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)]  # q k v o gate up down
    return [s for _ in range(c.num_hidden_layers) for i, o in projections for s in [(rank, i), (o, rank)]]


def bench_adamw(device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    if not dist.is_initialized():  # DTensors need a mesh: a one-process group
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl", store=dist.HashStore(),
                                rank=0, world_size=1)
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    c = qf.CONFIGS["llama2-7b"]
    shapes = adapter_shapes(c)
    blocks = c.num_hidden_layers

    def param(shape, dtensor=False):  # with a gradient, drawn as a plain tensor and then sharded
        t, g = torch.randn(shape, device=device), torch.randn(shape, device=device)
        if dtensor:
            t, g = (distribute_tensor(x, mesh, [Shard(0)]) for x in (t, g))
        p = nn.Parameter(t)
        p.grad = g
        return p

    def tensors(dtensor):
        return [param(s, dtensor) for s in shapes]

    def flat_shards():  # one flat fp32 shard per block, as qlora_fsdp's FSDP handed it before
        per_block = sum(math.prod(s) for s in shapes) // blocks // world
        return [param((per_block,)) for _ in range(blocks)]

    def views():  # what FSDP hands its optimizer now: each parameter's piece, a view of its block's master
        params, per_block = [], shapes[: len(shapes) // blocks]
        for _ in range(blocks):
            sizes = [-(-math.prod(s) // world) for s in per_block]
            master, grads = torch.randn(sum(sizes), device=device), torch.randn(sum(sizes), device=device)
            for piece, grad in zip(master.split(sizes), grads.split(sizes)):
                p = nn.Parameter(piece)
                p.grad = grad
                params.append(p)
        return params

    rows = {"ours, each parameter a view of its block's master": qf.AdamW(views(), lr=1e-4),
            "ours, a flat shard per block": qf.AdamW(flat_shards(), lr=1e-4),
            f"ours, over the {len(shapes)} tensors": qf.AdamW(tensors(False), lr=1e-4),
            "torch AdamW over DTensor (default)": torch.optim.AdamW(tensors(True), lr=1e-4),
            "torch AdamW over DTensor (foreach)": torch.optim.AdamW(tensors(True), lr=1e-4, foreach=True),
            "torch AdamW, plain tensors (foreach)": torch.optim.AdamW(tensors(False), lr=1e-4, foreach=True)}
    print(f"AdamW step over Llama-2-7B's {sum(math.prod(s) for s in shapes) / 1e6:.1f} M adapter params "
          f"({len(shapes)} tensors, {blocks} blocks) on {device}:")
    results, ours = {}, None
    for k, opt in rows.items():
        ms = median_ms(opt.step, 7)
        ours = ours or ms
        print(f"  {k:<38} {ms:8.2f} ms   {ms / ours:5.2f}x ours")
        results[f"optimizer_ms {k}"] = round(ms, 3)
    dist.destroy_process_group()
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads (default: torch's); 1 is steadier on a machine shared with other jobs")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = bench_dequantize(device)
    results.update(bench_adamw(device))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
