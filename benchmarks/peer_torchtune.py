"""The peer: torchtune's QLoRA recipe as it builds and runs a step -- its own Llama 3 model
(`lora_llama3`, quantize_base=True: torchao's NF4 on the 7 projections, LoRA on all of them, the
output projection dense), FSDP2 through `training.shard_model` (one unit per decoder layer, then the
root), activation checkpointing per layer (`training.set_activation_checkpointing`), each layer
compiled (`training.compile_model`), the loss `CEWithChunkedOutputLoss` (8 chunks, its cross
entropy compiled), torch's AdamW -- at qlora_fsdp's shapes.

  torchrun --nproc_per_node 2 benchmarks/peer_torchtune.py --model small --batch_size 8 --seq_len 128 --steps 12
  ... [--no-compile] [--fused]        (--fused: AdamW(fused=True), torchtune's GPU default)

It takes qlora_fsdp's flags where they apply (model, batch, context, steps, LoRA rank and alpha, lr,
clip, seed, compile, checkpointing; random tokens) and ends, like the trainer, with one JSON line on
rank 0: step_ms (median, first step left out), tokens_per_s, peak_mem_gib. torchtune 0.6.1 needs
torchao 0.15 (its import path); neither is a dependency of qlora_fsdp.
"""

import json
import os
import resource
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torchtune import modules, training
from torchtune.models.llama3._component_builders import lora_llama3
from torchtune.modules.loss import CEWithChunkedOutputLoss

import _common  # noqa: F401  (puts the repository on sys.path)
import qlora_fsdp as qf  # noqa: E402


def build(config, args):
    """torchtune's QLoRA Llama at qlora_fsdp's config, in bf16 (as its recipe runs)."""
    with torch.device("cpu"):
        model = lora_llama3(
            lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
            apply_lora_to_mlp=True,
            apply_lora_to_output=False,
            vocab_size=config.vocab_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            embed_dim=config.hidden_size,
            max_seq_len=max(args.seq_len, 256),
            intermediate_dim=config.intermediate_size,
            norm_eps=config.rms_norm_eps,
            rope_base=config.rope_theta,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            quantize_base=True,
        )
    return model.to(torch.bfloat16)


def main(argv):
    fused = "--fused" in argv
    args = qf.parse_args([a for a in argv if a != "--fused"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = qf.CONFIGS[args.model]
    torch.manual_seed(args.seed)
    model = build(config, args)
    # torchtune's recipe: only the adapters train.
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    if args.checkpointing:
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    layer = modules.TransformerSelfAttentionLayer
    training.shard_model(model, [lambda n, m: isinstance(m, layer)], cpu_offload=False)
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    if args.compile:
        training.compile_model(model, verbose=False)
        loss_fn = training.compile_loss(loss_fn, verbose=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay, fused=fused)
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y, _ = qf.get_batch(None, step, 0, args, world, rank, config.vocab_size)
        logits = model(x)
        loss = loss_fn(logits, y)  # the mean over the targets
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        loss /= world
        loss.item()
        times.append(time.perf_counter() - t0)
    peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30)  # Linux: KiB
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step_ms = float(np.median(times[1:] if len(times) > 1 else times)) * 1000
    if rank == 0:
        print(json.dumps(dict(peer="torchtune QLoRA (FSDP2 + torchao NF4)", model=args.model, world_size=world,
                              batch_size=args.batch_size, seq_len=args.seq_len, compile=args.compile,
                              fused_adamw=fused, final_loss=loss.item(), step_ms=round(step_ms, 2),
                              tokens_per_s=round(args.batch_size * args.seq_len * world / step_ms * 1000, 1),
                              peak_mem_gib=round(peak.item(), 4))), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
