"""The peer: PyTorch's fully_shard (FSDP2) with torchao's NF4Tensor, the stack the talk measured
(torchtune's QLoRA recipe), run on qlora_fsdp's own Llama, batches, LoRA and checkpointing, so
that only the sharding and the NF4 linear differ from `qlora_fsdp.py` with the same flags.

  torchrun --nproc_per_node 2 benchmarks/peer_torchao.py --model small --batch_size 8 --seq_len 128 --steps 12

It takes qlora_fsdp's flags (those that apply: model, batch, context, steps, LoRA, lr, clip, seed,
data, compile, checkpointing) and ends, like the trainer, with one JSON line on rank 0: step_ms
(median, first step left out), tokens_per_s, peak_mem_gib (max over ranks; GPU allocated on CUDA,
resident set on the CPU). One GPU per rank over NCCL where there are GPUs, gloo on CPUs.
torchao is not a dependency of qlora_fsdp; this script needs it.
"""

import json
import os
import resource
import sys
import time
import types

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

try:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4
except ImportError:  # torchao before the quantize_ workflows
    from torchao.dtypes.nf4tensor import linear_nf4, to_nf4

import _common  # noqa: F401  (puts the repository on sys.path)
import qlora_fsdp as qf  # noqa: E402


def lora_forward(self, x, xA=None):
    """LoRALinear.forward with torchao's NF4 linear (no dropout: benchmarks run without it); xA is
    x A^T when the layers reading x share that matmul, as ours do."""
    xA = F.linear(x, self.lora_A.to(x.dtype)) if xA is None else xA
    return linear_nf4(x, self.weight) + self.scaling * F.linear(xA, self.lora_B.to(x.dtype))


def to_torchao(model, device):
    """Every NF4 weight re-quantized by torchao on `device`, every other parameter moved there."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if isinstance(p, qf.NF4Tensor):
                new = to_nf4(p.dequantize(torch.bfloat16).to(device))
            else:
                new = p.detach().to(device)
            setattr(module, name, nn.Parameter(new, requires_grad=p.requires_grad))
        if isinstance(module, qf.LoRALinear):
            module.forward = types.MethodType(lora_forward, module)


def main(argv=None):
    args = qf.parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    config = qf.CONFIGS[args.model]
    torch.manual_seed(args.seed)
    model = qf.Llama(config, torch.bfloat16, args.lora_rank, args.lora_alpha)
    model.checkpointing = args.checkpointing
    to_torchao(model, device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.compile:  # torchtune's compile=True: each block compiled
        for layer in model.model.layers:
            layer.compile()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay)
    data = None if args.data == "dummy" else qf.load_tokens(args.data or qf.__file__, config.vocab_size)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for step in range(args.steps):
        sync()
        t0 = time.perf_counter()
        x, y, _ = qf.get_batch(data, step, 0, args, world, rank, config.vocab_size)
        loss = model(x.to(device), y.to(device))
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)  # the mean over ranks: SUM / world (gloo before 2025 has no AVG)
        loss /= world
        loss.item()
        sync()
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    peak = torch.tensor(float(peak) / 2**30, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step_ms = float(np.median(times[1:] if len(times) > 1 else times)) * 1000
    if rank == 0:
        print(json.dumps(dict(peer="fully_shard + torchao NF4", model=args.model, world_size=world,
                              device=device.type, batch_size=args.batch_size, seq_len=args.seq_len,
                              compile=args.compile, final_loss=loss.item(), step_ms=round(step_ms, 2),
                              tokens_per_s=round(args.batch_size * args.seq_len * world / step_ms * 1000, 1),
                              peak_mem_gib=round(peak.item(), 4))), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
