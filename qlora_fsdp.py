"""
qlora_fsdp.py: fine-tune Llama models that do not fit on a GPU, all of it in this one file.

QLoRA (a frozen 4-bit NormalFloat base with small trainable LoRA adapters) sharded across processes the way
PyTorch's FSDP2 does it, written out by hand on torch.distributed: the talk "Slaying OOMs with PyTorch FSDP and
torchao" (Mark Saroufim, Jane Xu) turned into code, one lesson per section, each needing only the ones above it:

  1. memory accounting          parameters + gradients + optimizer state, full vs QLoRA
  2. NF4 quantization           blocks of 64, codebook, nibble packing, double-quantized scales
  3. NF4 tensor subclass        NF4 weights that behave like tensors (F.linear, .to, save/load)
  4. LoRA                       frozen NF4 base + trainable low-rank adapters
  5. sharding and offload       per-parameter shards, one all-gather per unit, reduce-scatter
  6. foreach AdamW              one kernel launch per op for all shards
  7. Llama                      Hugging Face names, RoPE, GQA, SwiGLU, chunked cross entropy
  8. predicting the peak        every buffer of a training step, before allocating one
  9. Hugging Face checkpoints   safetensors in and out, streamed loading, PEFT adapters, resume
 10. data, training loop, CLI   a log line per step, a JSON summary, --estimate, --fit, --val_data, --profile

Run it:
  python qlora_fsdp.py                                   # tiny model on this file's bytes, CPU
  torchrun --nproc_per_node 2 qlora_fsdp.py              # the same, sharded over 2 processes
  torchrun --nproc_per_node 2 qlora_fsdp.py --model llama2-7b --data dummy --batch_size 8 --seq_len 2048
  WORLD_SIZE=2 python qlora_fsdp.py --model llama2-7b --batch_size 8 --seq_len 2048 --estimate --fit 24
  torchrun --nproc_per_node 2 qlora_fsdp.py --checkpoint DIR --data train.npy --out runs/a
  python qlora_fsdp.py --sample 200 --prompt "def "      # then continue a prompt by 200 tokens
"""

import argparse
import contextlib
import io
import itertools
import json
import math
import os
import random
import re
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils.checkpoint import checkpoint

GiB = 1024**3

# -----------------------------------------------------------------------------
# 1. Memory accounting: where the bytes go before a single activation exists
# -----------------------------------------------------------------------------
# Needs: nothing (a config's attributes).
# Full fine-tuning in bf16 keeps, per parameter: the weight (2 B), its gradient (2 B) and Adam's two moments
# (2 x 2 B): 8 B/param, so a 7B model needs 56 GB (Llama-2-7B, 6.74 B parameters: 13.5 + 13.5 + 27 = 54 GB).
# QLoRA freezes the base in NF4 (~0.516 B/param, section 2) and trains only LoRA adapters, kept in fp32 (4 B)
# with fp32 gradients (4 B) and two fp32 moments (8 B): 16 B per *adapter* parameter, of which there are ~0.3%.

# NF4 storage per 64 weights (section 2): 32 B of codes + 1 B int8 scale, + 4 B fp32 factor per 256 scales:
# 4 + 8/64 + 32/(64*256) = 4.127 bits/param (the paper's 0.127 bits of scale overhead).
NF4_BITS_PER_PARAM = 4 + 8 / 64 + 32 / (64 * 256)

def linear_shapes(config):
    """(out, in) of each of a Llama block's 7 projections, by their Hugging Face names."""
    d, ffn = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {"self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
            "self_attn.o_proj": (d, q), "mlp.gate_proj": (ffn, d), "mlp.up_proj": (ffn, d), "mlp.down_proj": (d, ffn)}

def count_params(config, lora_rank=8):
    """Parameter counts of a Llama config: (linear weights of the blocks, lm_head,
    embeddings + norms, LoRA adapters on the 7 projections of every block)."""
    d, layers, shapes = config.hidden_size, config.num_hidden_layers, linear_shapes(config).values()
    linear, lora = layers * sum(o * i for o, i in shapes), layers * sum(lora_rank * (i + o) for o, i in shapes)
    return linear, config.vocab_size * d, config.vocab_size * d + (2 * layers + 1) * d, lora  # dense: embed + norms

def memory_budget(config, lora_rank=8):
    """Bytes of weights, gradients and optimizer state: full bf16 fine-tuning vs QLoRA."""
    linear, head, dense, lora = count_params(config, lora_rank)
    total, nf4 = linear + head + dense, (linear + head) * NF4_BITS_PER_PARAM / 8
    return {"full_bf16": {"params": 2 * total, "grads": 2 * total, "optimizer": 4 * total},
            "qlora": {"params": nf4 + 2 * dense + 4 * lora, "grads": 4 * lora, "optimizer": 8 * lora},
            "n_params": total, "n_lora": lora}

def fmt_bytes(n):
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"

def format_budget(name, budget):
    rows = [f"memory before activations, {name} ({budget['n_params'] / 1e6:,.1f} M params, "
            f"{budget['n_lora'] / 1e6:,.2f} M LoRA params):"]
    for method, label in (("full_bf16", "full fine-tune, bf16"), ("qlora", "QLoRA, NF4 base")):
        b = budget[method]
        rows.append(f"  {label:<21} params {fmt_bytes(b['params']):>9} + grads {fmt_bytes(b['grads']):>9}"
                    f" + Adam {fmt_bytes(b['optimizer']):>9} = {fmt_bytes(sum(b.values())):>9}")
    return "\n".join(rows)

# -----------------------------------------------------------------------------
# 2. NF4 quantization with double-quantized scales (QLoRA, Dettmers et al. 2023)
# -----------------------------------------------------------------------------
# Needs: import sys, torch, torch.nn.functional as F.
# NormalFloat-4: 16 values placed at quantiles of N(0, 1), rescaled to [-1, 1], with an exact 0.
# Paper Appendix E; bitsandbytes get_4bit_type("nf4"). Code i is NF4[i], ascending.
NF4_VALUES = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
              -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
              0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
              0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
NF4 = torch.tensor(NF4_VALUES, dtype=torch.float32)
# Nearest-value rounding == bucketize on the 15 midpoints: no (numel x 16) distance matrix.
NF4_MIDPOINTS = [(a + b) / 2 for a, b in zip(NF4_VALUES[:-1], NF4_VALUES[1:])]

# torch.compile turns the plain-Python kernels below into fused loops (CUDA: Triton, CPU: C++). Every function
# and layer of sections 2-4 takes compile=None (this default), True or False; both give the same bits. The
# first compiled call of each kernel compiles it: seconds on a CPU, the quantize kernel the longest.
COMPILE = True
QUANT_CHUNK = 1 << 24  # elements quantized per call, so a huge matrix never has a full fp32 copy

def use_compiled(compile, t):
    """Whether to run a separately compiled kernel on t: `compile` (None: COMPILE), except inside an outer
    torch.compile (the plain function is traced into that graph) and on meta tensors."""
    return (COMPILE if compile is None else compile) and t.device.type != "meta" and not torch.compiler.is_compiling()

def _quantize_blocks(w, block_size: int):
    """w: (n_blocks * block_size,) float -> packed codes (numel/2,) uint8, absmax (n_blocks,) fp32. Each block is
    scaled by its exact absmax into [-1, 1], rounded to the nearest NF4 value (as bitsandbytes and torchao do)."""
    blocks = w.float().view(-1, block_size)  # (n_blocks, 64)
    absmax = blocks.abs().amax(dim=1)  # (n_blocks,)
    normalized = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    codes = torch.bucketize(normalized, torch.tensor(NF4_MIDPOINTS, device=w.device)).to(torch.uint8).view(-1)
    # two codes per byte, first element in the high nibble: [a, b, c, d] -> [ab, cd]
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed, absmax

def _double_quantize(absmax, scaler_block_size: int):
    """The fp32 block scales to int8, torchao's scheme: subtract the global mean, then per group of 256 scales
    factor = 127 / absmax(group), q = round(s * factor) (torchao uses 128 and clamps, clipping each group's largest
    scale a step; 127 never clips); a partial last group is zero padded. -> scale_q (n_blocks,) int8,
    scale_factor (n_groups,) fp32, scale_mean () fp32."""
    n, mean = absmax.numel(), absmax.mean()
    padded = F.pad(absmax - mean, (0, -n % scaler_block_size)).view(-1, scaler_block_size)  # (n_groups, 256)
    factor = 127.0 / padded.abs().amax(dim=1).clamp_min(1e-30)  # finite for a group of equal scales (0s)
    q = (padded * factor[:, None]).round().clamp(-128, 127).to(torch.int8).view(-1)[:n]
    return q, factor, mean

def _absmax(scale_q, scale_factor, scale_mean, scaler_block_size: int):
    """The (n_blocks,) fp32 block scales back from their int8 codes: q / factor[group] + mean."""
    group = torch.arange(scale_q.numel(), device=scale_q.device) // scaler_block_size
    return scale_q.float() / scale_factor[group] + scale_mean

_NF4_ON_DEVICE = {}  # the codebook, copied to each device once
DEQUANT_CHUNK = 1 << 22  # elements per pass

def _dequantize(packed, scale_q, scale_factor, scale_mean, block_size: int, scaler_block_size: int, dtype: torch.dtype):
    """Inverse of quantize_nf4: (numel,) tensor of `dtype`, row-major, w = NF4[code] * absmax[block]. The reference,
    and the path for --no-compile and every dtype but bf16: codes index the codebook as int32, a chunk (at most
    half the weight) at a time, so that no temporary (4-byte codes and values) outgrows the output."""
    if packed.device not in _NF4_ON_DEVICE:
        _NF4_ON_DEVICE[packed.device] = NF4.to(packed.device)
    table, absmax = _NF4_ON_DEVICE[packed.device], _absmax(scale_q, scale_factor, scale_mean, scaler_block_size)
    blocks = packed.view(-1, block_size // 2)  # (n_blocks, 32)
    out = torch.empty(blocks.shape[0], block_size, dtype=dtype, device=packed.device)  # (n_blocks, 64)
    # blocks per chunk: DEQUANT_CHUNK elements, at most half the weight (packed.numel() is numel / 2)
    step = max(1, min(DEQUANT_CHUNK, packed.numel()) // block_size)
    for byte, scale, chunk in zip(blocks.split(step), absmax.split(step), out.split(step)):
        codes = torch.stack([byte >> 4, byte & 0xF], dim=-1).view(-1).int()  # unpack the nibbles
        values = table.index_select(0, codes).view(-1, block_size)  # (blocks in the chunk, 64)
        chunk.copy_(values.mul_(scale[:, None]))
    return out.view(-1)

# What torch.compile gets for bf16 output: the same bits in a form it vectorizes (the table lookup above compiles
# to a gather, the nibbles' interleaving to scalar stores): (1) the lookup is a tree of selects between constants;
# (2) each byte's two bf16 results, rounded on the bits, are packed into one int32 (the first in the low half, as
# little-endian memory orders them), written contiguously and viewed as bf16 afterwards.
def _nf4_lookup(code):
    """NF4_VALUES[code] for an integer tensor of codes 0..15, without indexing: bit 0 of the code picks within
    each pair of values, bit 1 within pairs of pairs, ... (15 selects, 4 levels)."""
    values = NF4_VALUES
    for bit in range(4):
        take_upper = (code & (1 << bit)) != 0
        values = [torch.where(take_upper, hi, lo) for lo, hi in zip(values[0::2], values[1::2])]
    return values[0]

def _bf16_bits(x):
    """fp32 x -> the 16 bits of x.to(torch.bfloat16) (round to nearest even; finite x), in an int32."""
    bits = x.view(torch.int32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF

def _dequantize_bf16_pairs(packed, scale_q, scale_factor, scale_mean, block_size: int, scaler_block_size: int):
    """(numel/2,) int32: each the two bf16 values of one packed byte; .view(torch.bfloat16) is _dequantize's."""
    absmax = _absmax(scale_q, scale_factor, scale_mean, scaler_block_size)[:, None]  # (n_blocks, 1)
    byte = packed.view(-1, block_size // 2).int()  # (n_blocks, 32)
    first = _bf16_bits(_nf4_lookup(byte >> 4) * absmax)  # elements 0, 2, 4, ... of each block
    second = _bf16_bits(_nf4_lookup(byte & 0xF) * absmax)  # elements 1, 3, 5, ...
    return (first | (second << 16)).view(-1)

_quantize_blocks_compiled = torch.compile(_quantize_blocks, dynamic=True)
_dequantize_bf16_pairs_compiled = torch.compile(_dequantize_bf16_pairs, dynamic=True)

# Inside a bigger compiled graph (a compiled block), the kernel above, traced into it, loses its vectorization
# to the int32 -> bf16 view. As a custom op it stays one opaque call there, running the compiled kernel.
@torch.library.custom_op("qlora_fsdp::dequantize_nf4_bf16", mutates_args=())
def _dequantize_bf16(packed: torch.Tensor, scale_q: torch.Tensor, scale_factor: torch.Tensor,
                     scale_mean: torch.Tensor, block_size: int, scaler_block_size: int) -> torch.Tensor:
    args = (packed, scale_q, scale_factor, scale_mean, block_size, scaler_block_size)
    return _dequantize_bf16_pairs_compiled(*args).view(torch.bfloat16)

@_dequantize_bf16.register_fake
def _(packed, scale_q, scale_factor, scale_mean, block_size, scaler_block_size):
    return packed.new_empty(2 * packed.numel(), dtype=torch.bfloat16)

def quantize_nf4(weight, block_size=64, scaler_block_size=256, compile=None):
    """weight (any shape, numel % block_size == 0) -> (packed, scale_q, scale_factor, scale_mean)."""
    if weight.numel() % block_size or weight.numel() == 0:
        raise ValueError(f"NF4 needs a positive number of elements divisible by block_size={block_size}; got shape "
                         f"{tuple(weight.shape)} ({weight.numel()} elements)")
    if block_size % 2:
        raise ValueError(f"block_size must be even (two codes per byte), got {block_size}")
    kernel = _quantize_blocks_compiled if use_compiled(compile, weight) else _quantize_blocks
    flat, step = weight.detach().reshape(-1), max(block_size, QUANT_CHUNK // block_size * block_size)
    with torch.no_grad():  # chunked: a big matrix never has a whole fp32 copy
        chunks = [kernel(flat[i:i + step], block_size) for i in range(0, flat.numel(), step)]
    packed, absmax = map(torch.cat, zip(*chunks))
    if absmax.device.type != "meta" and not absmax.isfinite().all():  # through the scales' mean: every block
        raise ValueError(f"NF4 cannot quantize a weight holding inf or NaN (shape {tuple(weight.shape)})")
    return (packed,) + _double_quantize(absmax, scaler_block_size)

def dequantize_nf4(packed, scale_q, scale_factor, scale_mean, block_size=64, scaler_block_size=256,
                   dtype=torch.bfloat16, compile=None):
    """quantize_nf4's four tensors -> the weight, flat (numel,), in `dtype`. Compiled and bf16: the kernel above,
    an opaque custom op (so also inside an outer torch.compile); else the eager reference."""
    args = (packed, scale_q, scale_factor, scale_mean, block_size, scaler_block_size)
    fast = (use_compiled(compile, packed) or torch.compiler.is_compiling()) and packed.device.type != "meta"
    with torch.no_grad():  # frozen weights: never part of the autograd graph
        if fast and dtype == torch.bfloat16 and sys.byteorder == "little":
            return _dequantize_bf16(*args)
        return _dequantize(*args, dtype)

# -----------------------------------------------------------------------------
# 3. NF4Tensor: a tensor subclass so 4-bit weights behave like ordinary tensors
# -----------------------------------------------------------------------------
# Needs: import torch, torch.nn.functional as F; from typing import Optional; from above: quantize_nf4,
# dequantize_nf4.
# A "wrapper" subclass has no storage of its own: it reports the original shape and float dtype and holds four
# inner tensors; F.linear, .to(), torch.save and torch.compile see a tensor. A (out, in) weight, numel = out * in:
#   packed        (numel/2,)  uint8   codes, row-major, first element of each pair in the high nibble
#   scale_q       (numel/64,) int8    double-quantized absmax of each block of 64
#   scale_factor  (ceil(numel/64/256),) fp32  per group of 256 scales (a partial last group too)
#   scale_mean    ()          fp32    mean subtracted from the scales
# Everything is flat, so sharding (section 5) can split each inner tensor in its own dtype.

aten = torch.ops.aten

class NF4Tensor(torch.Tensor):
    """A 4-bit weight (the layout above) as a tensor of its shape and float dtype: F.linear, .to(), .cpu()/.cuda(),
    pin_memory, clone, copy_, torch.save and torch.compile work on it; any other op raises, naming itself."""
    INNER = ("packed", "scale_q", "scale_factor", "scale_mean")

    @staticmethod
    def __new__(cls, packed, scale_q, scale_factor, scale_mean, shape, dtype, *block_sizes, **kw_block_sizes):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=packed.device)

    def __init__(self, packed, scale_q, scale_factor, scale_mean, shape, dtype, block_size=64, scaler_block_size=256):
        self.packed, self.scale_q, self.scale_factor, self.scale_mean = packed, scale_q, scale_factor, scale_mean
        self.block_size, self.scaler_block_size = block_size, scaler_block_size

    def _with_inner(self, fn):  # a new NF4Tensor whose inner tensors are fn(inner); same shape, dtype, block sizes
        return NF4Tensor(*(fn(getattr(self, n)) for n in self.INNER), self.shape, self.dtype,
                         self.block_size, self.scaler_block_size)

    def dequantize(self, dtype=None, compile=None):
        return dequantize_nf4(self.packed, self.scale_q, self.scale_factor, self.scale_mean, self.block_size,
                              self.scaler_block_size, dtype or self.dtype, compile).view(self.shape)

    # torch.compile flattens the subclass into its inner tensors and rebuilds it from them.
    def __tensor_flatten__(self):
        return list(self.INNER), (tuple(self.shape), self.dtype, self.block_size, self.scaler_block_size)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        shape, dtype, block_size, scaler_block_size = meta
        return NF4Tensor(*(inner[n] for n in NF4Tensor.INNER), shape, dtype, block_size, scaler_block_size)

    def __repr__(self):
        return (f"NF4Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"block_size={self.block_size})")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:  # y = x W^T (+ b), gradient for x only
            x, w, bias = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias")
            y = linear_nf4(x, w)
            return y if bias is None else y + bias
        # .to(dtype) dequantizes, even to its own dtype (how one asks for the dense weight); .to(device) stays packed
        if func is torch.Tensor.to:
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            t = _nf4_to_copy(args[0], device, non_blocking=non_blocking)
            return t.dequantize(dtype) if dtype is not None else t
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _NF4_OPS:
            return _NF4_OPS[func](*args, **(kwargs or {}))
        raise NotImplementedError(f"NF4Tensor does not support {func}; call .dequantize() first")

def _nf4_to_copy(t, device=None, dtype=None, non_blocking=False, **_):
    """A move (.to(device); .cpu(), .cuda() as aten._to_copy) keeps the data packed; a cast (.float()) dequantizes."""
    if device is not None and device != t.device:
        t = t._with_inner(lambda x: x.to(device, non_blocking=non_blocking))
    return t.dequantize(dtype) if dtype is not None and dtype != t.dtype else t

def _nf4_copy_(dst, src, non_blocking=False):
    """dst.copy_(src): src is an NF4Tensor with the same layout (exact), or dense (quantized from dst's dtype)."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"copy_ into NF4Tensor of shape {tuple(dst.shape)} from shape {tuple(src.shape)}")
    src = src if isinstance(src, NF4Tensor) else to_nf4(src.to(dst.dtype), dst.block_size, dst.scaler_block_size)
    for n in NF4Tensor.INNER:
        getattr(dst, n).copy_(getattr(src, n), non_blocking=non_blocking)
    return dst

# Every op an NF4Tensor supports (anything else raises, naming the op). A clone copies the codes exactly.
_NF4_OPS = {
    aten.detach.default: lambda t: t._with_inner(aten.detach.default),
    aten.alias.default: lambda t: t._with_inner(aten.alias.default),
    aten.clone.default: lambda t, **_: t._with_inner(torch.clone),
    aten._pin_memory.default: lambda t, *_: t._with_inner(torch.Tensor.pin_memory),
    aten.is_pinned.default: lambda t, *_: all(getattr(t, n).is_pinned() for n in NF4Tensor.INNER),
    aten._to_copy.default: _nf4_to_copy, aten.copy_.default: _nf4_copy_}

def to_nf4(weight, block_size=64, scaler_block_size=256, compile=None):
    """Quantize a float tensor to an NF4Tensor that reports weight's shape and dtype."""
    inner = quantize_nf4(weight, block_size, scaler_block_size, compile)
    return NF4Tensor(*inner, weight.shape, weight.dtype, block_size, scaler_block_size)

# y = x W^T with W frozen in NF4, as a custom op whose backward, grad_x = grad_y W, is the same op (W dequantized
# again): saved for backward are the packed inner tensors, never a dense W. Not an autograd.Function: torch.compile
# traces through one, and its CSE merges forward's and backward's dequantize into one call whose dense result is
# kept for backward -- QLoRA's saving, gone. An op is opaque to the compiler: the two stay apart.
@torch.library.custom_op("qlora_fsdp::matmul_nf4", mutates_args=())
def _matmul_nf4(x: torch.Tensor, packed: torch.Tensor, scale_q: torch.Tensor, scale_factor: torch.Tensor,
                scale_mean: torch.Tensor, out_features: int, block_size: int, scaler_block_size: int,
                transpose: bool, compile: Optional[bool]) -> torch.Tensor:
    """x W^T, (..., in) -> (..., out), if transpose (forward), else x W, (..., out) -> (..., in)."""
    w = dequantize_nf4(packed, scale_q, scale_factor, scale_mean, block_size, scaler_block_size, x.dtype, compile)
    return x @ (w.view(out_features, -1).T if transpose else w.view(out_features, -1))  # W: (out, in)

@_matmul_nf4.register_fake
def _(x, packed, scale_q, scale_factor, scale_mean, out_features, block_size, scaler_block_size, transpose, compile):
    return x.new_empty(*x.shape[:-1], out_features if transpose else 2 * packed.numel() // out_features)

def _matmul_nf4_setup(ctx, inputs, output):  # saved: packed, scale_q, scale_factor, scale_mean; and the rest
    ctx.save_for_backward(*inputs[1:5])
    ctx.meta = inputs[5:]  # out_features, block_size, scaler_block_size, transpose, compile

def _matmul_nf4_backward(ctx, grad):
    *meta, transpose, compile = ctx.meta
    grad_x = _matmul_nf4(grad, *ctx.saved_tensors, *meta, not transpose, compile) if ctx.needs_input_grad[0] else None
    return (grad_x,) + (None,) * 9

_matmul_nf4.register_autograd(_matmul_nf4_backward, setup_context=_matmul_nf4_setup)

def linear_nf4(x, weight, compile=None):
    """y = x W^T for an NF4Tensor W; autograd gives a gradient to x only."""
    return _matmul_nf4(x, weight.packed, weight.scale_q, weight.scale_factor, weight.scale_mean,
                       weight.shape[0], weight.block_size, weight.scaler_block_size, True, compile)

# torch.load's safe (weights_only) unpickler must be told the class may be rebuilt.
torch.serialization.add_safe_globals([NF4Tensor])

# -----------------------------------------------------------------------------
# 4. LoRA over a frozen NF4 base (QLoRA)
# -----------------------------------------------------------------------------
# Needs: import math, random, torch, torch.nn as nn, torch.nn.functional as F; from above: NF4Tensor, to_nf4,
# linear_nf4.
# y = x W^T + (alpha / rank) * dropout(x) A^T B^T; W (out, in) frozen in NF4, A (rank, in), B (out, rank). B starts
# at zero: the model starts as the base (Hu et al. 2021). The adapters are fp32, cast to the compute dtype in
# forward (sharded: at all-gather).

def seeded(*key, device="cpu"):
    """A generator for one use, e.g. seeded(seed, "batch", step): the same draws on every rank, a stream of its own
    per key (seeded from a SHA-512 of it). A CUDA one draws other numbers than the CPU's, ~1000x as fast."""
    return torch.Generator(device).manual_seed(random.Random("/".join(map(str, key))).getrandbits(63))

def random_weight(shape, generator=None):
    """A random base for an (out, in) weight with no checkpoint: N(0, 1/in), on the generator's device."""
    return torch.randn(shape, generator=generator, device=generator and generator.device) * shape[-1] ** -0.5

def lora_A_init(shape, generator=None):
    """LoRA's A (rank, in) as nn.Linear and PEFT draw it: kaiming-uniform(a=sqrt(5)), U(-1/sqrt(in), 1/sqrt(in))."""
    return (torch.rand(shape, generator=generator) * 2 - 1) / math.sqrt(shape[-1])

class NF4Linear(nn.Module):
    """A frozen linear layer, y = x W^T (+ bias, optional, frozen), its weight an NF4Tensor: random unless given
    (a checkpoint's, from_linear's); compile: as in section 2, for this layer's NF4 kernels (None: COMPILE)."""

    def __init__(self, in_features, out_features, bias=False, dtype=torch.bfloat16, compile=None, weight=None):
        super().__init__()
        self.in_features, self.out_features, self.compile = in_features, out_features, compile
        w = random_weight((out_features, in_features)) if weight is None else weight.detach()
        self.weight = nn.Parameter(to_nf4(w.to(dtype), compile=compile), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear, *lora, compile=None, **lora_kw):
        """This class around an existing nn.Linear: its weight quantized (reporting its dtype), its bias
        kept, frozen; no base weight drawn. LoRALinear takes rank, alpha, dropout too (as its constructor)."""
        m = cls(linear.in_features, linear.out_features, *lora, dtype=linear.weight.dtype, compile=compile,
                weight=linear.weight, **lora_kw)
        m.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return m

    def forward(self, x):
        y = linear_nf4(x, self.weight, self.compile)
        return y if self.bias is None else y + self.bias

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A dense (Hugging Face) weight is quantized on the way in, with assign=True too (which skips copy_)
        if (key := prefix + "weight") in state_dict and not isinstance(state_dict[key], NF4Tensor):
            state_dict[key] = to_nf4(state_dict[key].to(self.weight.dtype), compile=self.compile)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

class LoRALinear(NF4Linear):
    """QLoRA's layer: NF4Linear's frozen W (and bias) plus trainable fp32 lora_A (rank, in), drawn as nn.Linear
    draws a weight (torch's global RNG), and lora_B (out, rank) = 0, so that it starts as the base layer."""

    def __init__(self, in_features, out_features, rank=8, alpha=16.0, dropout=0.0, bias=False,
                 dtype=torch.bfloat16, compile=None, weight=None):
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        super().__init__(in_features, out_features, bias, dtype, compile, weight)
        self.rank, self.scaling = rank, alpha / rank
        self.lora_A = nn.Parameter(lora_A_init((rank, in_features)))  # fp32
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, dtype=torch.float32))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x, xA=None):  # x (..., in) -> (..., out); xA: dropout(x) A^T if already made
        if xA is None:
            xA = F.linear(self.dropout(x), self.lora_A.to(x.dtype))  # (..., rank)
        y = linear_nf4(x, self.weight, self.compile)  # (..., out)
        # y + scaling * xA B^T as one addmm: a compiled backward recomputing it keeps the (..., out) sum alone
        y = torch.addmm(y.view(-1, y.shape[-1]), xA.view(-1, self.rank), self.lora_B.to(x.dtype).T,
                        alpha=self.scaling).view(y.shape)
        return y if self.bias is None else y + self.bias

    @staticmethod
    def shared_input(x, *layers):
        """[m(x) for m in layers] for LoRALinears that read the same x (q, k, v; gate, up), with one x [A_1; A_2]^T
        matmul for all: one pass over x, here and for the gradients. With dropout (a mask each) each runs alone."""
        if any(not isinstance(m.dropout, nn.Identity) for m in layers):
            return [m(x) for m in layers]
        xA = F.linear(x, torch.cat([m.lora_A for m in layers]).to(x.dtype))  # (..., sum of ranks)
        return [m(x, a) for m, a in zip(layers, xA.split([m.rank for m in layers], dim=-1))]

    def merged_weight(self, dtype=torch.float32):
        """W + (alpha/rank) B A, dense: what to export for serving without adapters."""
        w = self.weight.dequantize(torch.float32) + self.scaling * (self.lora_B.float() @ self.lora_A.float())
        return w.to(dtype)

# -----------------------------------------------------------------------------
# 5. Sharding and offload: FSDP2's idea written out on torch.distributed
# -----------------------------------------------------------------------------
# Needs: import contextlib, time, torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F,
# torch.utils._pytree as pytree.
#
# The model is cut into *units*, as FSDP2's fully_shard cuts it (Llama: the embeddings, each block, the final
# norm + lm_head; parameters in no unit form the root unit). Every tensor of a unit -- each inner tensor of a tensor
# subclass (an NF4 weight comes apart by __tensor_flatten__), each frozen and each trainable weight -- is flattened
# and split into `world` pieces of ceil(numel / world), zero padded; rank r keeps piece r in the dtype the tensor
# travels in (FSDP2 splits dim 0: the same order, but a flat split takes any shape at any world). One collective
# moves a unit's pieces, side by side in one byte buffer, widest dtypes first (so each starts aligned):
#
#   rank 0 shard bytes  [ q.scale_factor | ... | norm.w | q.lora_A | q.lora_B | ... | q.packed | q.scale_q | ... ]
#   rank 1 shard bytes  [ q.scale_factor | ... | norm.w | q.lora_A | q.lora_B | ... | q.packed | q.scale_q | ... ]
#        \__ all-gather __/
#   gathered (world, unit_bytes) -> one split_with_sizes_copy: each tensor's columns into its (world, shard bytes)
#   block of the unit's full storage -> the full tensors, on their modules while the unit is gathered
#
# A unit's life, run by hooks on its modules (FSDP2's, written small):
#   pre-forward:   wait for its all-gather (issued early: prefetch), issue the next unit's; its inputs pass
#                  through an identity autograd function whose backward marks the end of the unit's backward
#   post-forward:  free (storage resized to 0); a hook on each output tensor marks the start of its backward
#   pre-backward:  all-gather again, prefetch the previous unit
#   post-backward: (after the recompute and backward) one reduce-scatter, fp32, of the gradients (their mean); free
#   end of backward (a callback queued on the autograd engine): units whose inputs needed no gradient reduce
#                  now; every reduction is added to the masters' .grad: several backward() calls accumulate
# CPU offload keeps shards, fp32 masters, their gradients and the optimizer on the host. Plain tensors, not
# FSDP2's DTensors, whose dispatch every optimizer op would pay (section 6).

class _Slot:
    """One tensor of a unit, sharded: `world` pieces of shard_numel elements of `dtype` (it travels and computes in
    it), this rank's kept (`local`: in the unit's shard bytes or, trainable, its fp32 master) and the full tensor."""

    def __init__(self, name, tensor, dtype, trainable, world, rank):
        self.name, self.shape, self.dtype, self.trainable, self.rank = name, tuple(tensor.shape), dtype, trainable, rank
        self.numel, self.shard_numel = tensor.numel(), -(-tensor.numel() // world)  # ceil
        self.nbytes = self.shard_numel * dtype.itemsize
        self.offset = self.start = self.local = self.full = self.padded_bytes = None  # set by the unit

    def piece(self, full):
        """This rank's piece of a full tensor of this shape (on any device): flat, zero padded."""
        flat = full.detach().reshape(-1)[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]
        return F.pad(flat, (0, self.shard_numel - flat.numel()))

class _Param:
    """A parameter as slots: one for a plain tensor (floating: in the compute dtype), one per inner tensor, in its
    own dtype, for a tensor subclass (frozen), by __tensor_flatten__. `places`: the (module, name)s holding it."""

    def __init__(self, fqn, places, p, compute_dtype, world, rank):
        self.fqn, self.places, self.shape = fqn, places, tuple(p.shape)
        self.trainable = not (subclass := hasattr(p, "__tensor_flatten__")) and p.requires_grad
        if subclass:
            inner, ctx = p.__tensor_flatten__()
            names, cls, stride = [f"{fqn}.{n}" for n in inner], type(p), p.stride()  # the lambdas must not keep p alive
            self.flatten = lambda t: [getattr(t, n) for n in inner]
            self.unflatten = lambda full: cls.__tensor_unflatten__(dict(zip(inner, full)), ctx, self.shape, stride)
        else:
            names, self.flatten, self.unflatten = [fqn], lambda t: [t], lambda full: full[0]
        cast = compute_dtype if compute_dtype and not subclass else None  # a subclass keeps its inner dtypes
        self.slots = [_Slot(n, t, cast if cast and t.is_floating_point() else t.dtype, self.trainable, world, rank)
                      for n, t in zip(names, self.flatten(p))]  # (its full value, on its modules: set by the unit)

    def keep(self, full):  # a full tensor in this parameter's form (a subclass as such): keep this rank's pieces
        for s, t in zip(self.slots, self.flatten(full)):
            s.local.copy_(s.piece(t))

def _collective(out, inp, group, reduce_scatter=False):
    """Issue an all-gather, out (world * n,) = every rank's inp (n,) in rank order, or a reduce-scatter, out (n,) =
    rank r's piece of the sum of inp (world * n,); return its work. No process group: a copy."""
    if not dist.is_initialized():
        out.copy_(inp)
        return None
    if reduce_scatter:  # SUM: AVG is not in older gloo. The *_single names: torch 2.13's (the old ones warn there)
        return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, inp, op=dist.ReduceOp.SUM,
                                                                                   group=group, async_op=True)
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, inp, group=group, async_op=True)

@contextlib.contextmanager
def _side(stream):
    """Issue the `with` body's work on the side `stream`, after all the compute stream has queued so far, so that it
    overlaps what the compute stream does next. On the CPU (None): in order."""
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield

def _to_host(t, stream):
    """A host copy of t, made on the side stream; of a GPU t: pinned (so asynchronous), and t recorded on that
    stream, so that its memory is not reused before the copy has read it."""
    with _side(stream):
        if t.is_cuda:
            t.record_stream(stream)
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda).copy_(t, non_blocking=True)

class _PostBackward(torch.autograd.Function):
    """The identity on a unit's inputs: its backward runs once they have their gradients, once the unit's
    backward is done (FSDP2's RegisterPostBackwardFunction)."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # an input that gets no gradient: None, not a tensor of zeros
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward()
        return (None,) + grads

class _Sharded:  # mixed into the class of a module holding sharded parameters
    def __getattr__(self, name):  # a sharded parameter read outside its unit: a clear error, not a crash
        fqn = self.__dict__.get("_fsdp_sharded", {}).get(name)
        if fqn is None:
            return super().__getattr__(name)
        raise AttributeError(f"{fqn} is sharded by FSDP and exists only while its unit runs (forward, backward); "
                             f"FSDP.full_base() and full_adapters() gather it")

    def extra_repr(self):  # its own, unless it reads one of them (nn.Linear's reads its bias)
        with contextlib.suppress(AttributeError):
            return super().extra_repr()
        return "sharded by FSDP"

_SHARDED_CLASSES = {}  # a module's class -> the same with _Sharded

class ShardedUnit:
    """The parameters of some modules, sharded; hooks on those modules gather and free them."""

    def __init__(self, fsdp, index, name, modules, params, reshard_after_forward):
        self.fsdp, self.index, self.name, self.modules = fsdp, index, name, modules
        self.reshard_after_forward, world, dev = reshard_after_forward, fsdp.world, fsdp.device
        self.params = [_Param(fqn, places, p, fsdp.compute_dtype, world, fsdp.rank) for fqn, places, p in params]
        # the widest dtypes first, the trainable last among theirs: every piece aligned for its dtype, the masters'
        # in a row; frozen ones of a size no multiple of 16 last: the others start 16-aligned, as kernels assume
        self.slots = sorted((s for p in self.params for s in p.slots), key=lambda s: (
            s.nbytes % 16 != 0 and not s.trainable, -s.dtype.itemsize, str(s.dtype), s.trainable))
        self.adapters = [s for s in self.slots if s.trainable]
        self.unit_bytes = sum(s.nbytes for s in self.slots)
        pin = fsdp.offload and dev.type == "cuda"  # host memory the GPU copies from asynchronously
        self.shard_bytes = torch.zeros(self.unit_bytes, dtype=torch.uint8, device=fsdp.store_device, pin_memory=pin)
        # fp32 master of the trainable tensors: this rank's pieces in one flat tensor, laid out as a row of the
        # reduce-scatter's input (one optimizer tensor per unit; its padding stays 0 under AdamW)
        n = sum(s.shard_numel for s in self.adapters)
        self.master = nn.Parameter(torch.zeros(n, device=fsdp.store_device, pin_memory=pin)) if n else None
        if n:  # in place of the ones it shards: model.parameters() are what the optimizer steps, as with fully_shard
            modules[0].register_parameter("fsdp_master", self.master)
        # The full tensors: a (world, shard bytes) block of one storage each, in slot order, empty until gathered
        self.storage = torch.empty(world * self.unit_bytes, dtype=torch.uint8, device=dev).untyped_storage()
        self.casts, start, offset = {}, 0, 0  # casts: dtype -> its first and last trainable slot (one cast each)
        for s in self.slots:
            s.offset, offset = offset, offset + s.nbytes  # in the shard bytes
            if s.trainable:
                s.start, start = start, start + s.shard_numel
                s.local = self.master.detach()[s.start:start]  # detach(), not .data: writes bump the version
                self.casts[s.dtype] = (self.casts.get(s.dtype, (s,))[0], s)
            else:
                s.local = self.shard_bytes[s.offset:s.offset + s.nbytes].view(s.dtype)
            s.full = torch.empty(0, dtype=s.dtype, device=dev).set_(self.storage, world * s.offset // s.dtype.itemsize,
                                                                     s.shape).requires_grad_(s.trainable)
            s.padded_bytes = torch.empty(0, dtype=torch.uint8, device=dev).set_(self.storage, world * s.offset,
                                                                                (world, s.nbytes))
        self.storage.resize_(0)
        for p, (_, places, original) in zip(self.params, params):  # the parameters give way to the full tensors
            if original.device.type != "meta":  # a model built on "meta" is loaded later (load_full)
                p.keep(original)
            p.value = p.unflatten([s.full for s in p.slots])
            for m, attr in places:
                m._parameters.pop(attr, None)
                if "_fsdp_sharded" not in m.__dict__:
                    cls, m._fsdp_sharded = type(m), {}
                    m.__class__ = _SHARDED_CLASSES.setdefault(cls, type(cls.__name__, (_Sharded, cls), {}))
                m._fsdp_sharded[attr] = p.fqn
        self.places = [(m, attr, p.value) for p in self.params for m, attr in p.places]
        self.gathered = self.in_backward = self.needs_backward = False
        self.to_run, self.inflight, self.version = set(), None, None  # to_run: its modules yet to run forward
        for m in modules:
            m.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            m.register_forward_hook(self._post_forward)

    def _version(self):  # moves whenever this rank's pieces are written (an optimizer step, load_full)
        return self.shard_bytes._version, self.master is not None and self.master._version

    def prefetch(self):
        """Issue this unit's all-gather, unless gathered or in flight; it runs asynchronously (gloo: in a thread)."""
        fsdp = self.fsdp
        if self.gathered or self.inflight is not None or not self.slots:
            return
        # The receive buffer is the compute stream's, which reads and frees it (made on the side stream, its memory
        # could not be reused before the GPU caught up). On the side stream, after the optimizer's last update:
        # the shard's copy to the GPU (with offload) and the all-gather, overlapping the previous unit.
        out = torch.empty(fsdp.world * self.unit_bytes, dtype=torch.uint8, device=fsdp.device)
        with _side(fsdp.side_stream), torch.profiler.record_function("fsdp::all_gather"):
            send = self.shard_bytes.to(fsdp.device, non_blocking=True)  # no copy unless offloaded
            for first, last in self.casts.values():  # the fp32 masters cast into the wire dtype
                send[first.offset:last.offset + last.nbytes].view(first.dtype).copy_(
                    self.master.detach()[first.start:last.start + last.shard_numel], non_blocking=True)
            self.inflight = (_collective(out, send, fsdp.group), out)
        self.version = self._version()

    def gather(self):
        """Wait for this unit's all-gather (issued now unless prefetched; again if its pieces were written since),
        copy every tensor out of it in one op, and set the full tensors on their modules."""
        if self.version != self._version():  # gathered or prefetched before an optimizer step: stale
            self.free()
        if self.gathered or not self.slots:
            return
        self.prefetch()
        (work, out), self.inflight = self.inflight, None
        self.fsdp.wait(work, "fsdp::wait_all_gather")
        with torch.no_grad(), torch.profiler.record_function("fsdp::copy_out"):
            self.storage.resize_(self.fsdp.world * self.unit_bytes)
            torch.split_with_sizes_copy(out.view(self.fsdp.world, self.unit_bytes), [s.nbytes for s in self.slots],
                                        dim=1, out=[s.padded_bytes for s in self.slots])
        for m, attr, value in self.places:  # the full tensors on their modules, for as long as they exist
            m.__dict__[attr] = value
        self.gathered = True

    def free(self):
        if self.inflight is not None:  # a prefetch that will not be used: let it finish, drop it
            self.fsdp.wait(self.inflight[0], "fsdp::wait_all_gather")
        self.inflight = None
        self.storage.resize_(0)
        for m, attr, _ in self.places:
            m.__dict__.pop(attr, None)
        self.gathered, self.version = False, None

    @torch.compiler.disable  # the hooks stay eager under a torch.compile'd model (FSDP2's do too)
    def _pre_forward(self, module, args, kwargs):
        if self.index < 0:  # the root: a new forward of the whole model, every unit starts afresh
            for u in self.fsdp.all_units:
                u.to_run.clear()
        if self.to_run:  # another of this unit's modules started it
            return None
        self.to_run = set(self.modules)
        self.gather()
        if self.in_backward:  # a checkpoint around the module reruns it in backward: nothing more to do
            return None
        if self.index + 1 < len(self.fsdp.units):
            self.fsdp.units[self.index + 1].prefetch()  # it overlaps this unit's compute
        leaves, spec = pytree.tree_flatten((args, kwargs))
        need = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not torch.is_grad_enabled() or not need:  # no input needs a gradient: post-backward comes at the end
            return None
        for i, t in zip(need, _PostBackward.apply(self, *(leaves[i] for i in need))):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, spec)

    @torch.compiler.disable
    def _post_forward(self, module, args, output):
        self.to_run.discard(module)
        if self.to_run or self.in_backward:  # more of this unit to run; or a recompute inside backward
            return None
        if torch.is_grad_enabled():
            for t in pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:  # the first gradient to arrive starts backward
                    t.register_hook(self._pre_backward)
                    self.needs_backward = True
        if self.reshard_after_forward or not torch.is_grad_enabled():  # no backward after a no-grad forward
            self.free()

    def _pre_backward(self, grad):
        self.fsdp.queue_end_of_backward()
        if not self.in_backward:
            self.in_backward = True
            self.gather()
            if self.index > 0 and self.fsdp.units[self.index - 1].needs_backward:
                self.fsdp.units[self.index - 1].prefetch()  # the unit whose backward is next

    def post_backward(self):
        """This unit's backward is done: reduce-scatter its gradients, free its weights."""
        self.in_backward = self.needs_backward = False
        grads = [s.full.grad for s in self.adapters]
        if any(g is not None for g in grads):
            self.fsdp.reduce(self, [torch.zeros_like(s.full) if g is None else g for s, g in zip(self.adapters, grads)])
            for s in self.adapters:
                s.full.grad = None
        self.free()

class FSDP:
    """Shards `model` over `group` as FSDP2's fully_shard does, in plain tensors. `units`, in forward's order: modules
    or lists of modules gathered together; parameters in no unit form the root unit (a unit in a unit is its own; a
    parameter in two units is refused). compute_dtype (param_dtype): every plain floating parameter is kept and
    gathered in it; masters (one flat fp32 tensor per unit) and gradient reductions are fp32. device: the current
    GPU, else the CPU; offload: shards, masters and AdamW on the host. Outside its unit's forward and backward a
    parameter is off its module (reading it: an AttributeError); model.parameters() are the masters:

        model = nn.Sequential(nn.Embedding(1000, 64), *(Block(64) for _ in range(4)), nn.Linear(64, 1000))
        fsdp = FSDP(model, units=list(model), device="cuda", compute_dtype=torch.bfloat16)
        optimizer = AdamW(model.parameters(), lr=1e-4)  # (= fsdp.parameters()), made after FSDP
        for x, y in batches:                   # under torchrun: dist.init_process_group() first
            for x_micro, y_micro in zip(x.chunk(2), y.chunk(2)):
                F.cross_entropy(model(x_micro).flatten(0, 1), y_micro.flatten()).backward()  # accumulates
            fsdp.clip_grad_norm_(1.0)          # over all ranks (torch's would see this rank's shards)
            optimizer.step()
            optimizer.zero_grad()
        adapters = fsdp.full_adapters()        # {name: full fp32 tensor}, on every rank

    Units return tensors in tuples, lists, dicts; a unit's forward may be torch.compile'd. For checkpoints
    (collectives): full_adapters(of=...) (e.g. of=lambda m: optimizer.state[m]["exp_avg"]), full_base(), load_full."""

    def __init__(self, model, units, device=None, compute_dtype=None, offload=False, group=None):
        device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == torch.device("cuda") else device
        self.compute_dtype, self.offload, self.group = compute_dtype, offload, group
        self.world, self.rank = (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)
        self.store_device = torch.device("cpu") if offload else self.device
        self.waits, self.pending, self.arrived, self.task = [], None, [], None  # waits: (start, end) on collectives
        # CUDA: all-gathers and host copies go on a side stream, to overlap compute; the CPU runs them in order
        self.side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        groups = [[u] if isinstance(u, nn.Module) else list(u) for u in units]
        names, tops = {m: n for n, m in model.named_modules()}, {m for g in groups for m in g}
        outside = [type(m).__name__ for m in tops if m not in names]
        if outside:
            raise ValueError(f"FSDP: a unit's {outside[0]} is not a submodule of the model")
        found = {}  # id(parameter) -> (fqn, [(module, name), ...], parameter, unit index)

        def walk(m, prefix, i):  # m's parameters and its children's, but not those of units of their own
            for attr, p in m._parameters.items():
                if p is not None:
                    entry = found.setdefault(id(p), (prefix + attr, [], p, i))
                    if entry[3] != i:
                        raise ValueError(f"FSDP: parameter {prefix + attr} (also {entry[0]}) is in two units; "
                                         f"put the modules that share it in one unit")
                    entry[1].append((m, attr))
            for n, c in m._modules.items():
                if c is not None and c not in tops:
                    walk(c, f"{prefix}{n}.", i)
        for m, i in [(model, -1)] + [(m, i) for i, g in enumerate(groups) for m in g]:  # the root's, then each unit's
            walk(m, f"{names[m]}." if names[m] else "", i)
        params = [[(fqn, places, p) for fqn, places, p, j in found.values() if j == i] for i in range(-1, len(groups))]
        self.root = ShardedUnit(self, -1, "root", [model], params[0], reshard_after_forward=False)
        self.units = [ShardedUnit(self, i, "+".join(names[m] for m in g), g, params[i + 1],
                                  reshard_after_forward=i < len(groups) - 1) for i, g in enumerate(groups)]
        self.all_units = [self.root] + self.units
        self.trained = [u for u in self.all_units if u.master is not None]  # the units with trainable tensors
        self.param_of = {p.fqn: (u, p) for u in self.all_units for p in u.params}
        for m in model.modules():  # buffers are not sharded: they move to the device, as FSDP2 moves them
            m._buffers.update({k: b.to(self.device) for k, b in m._buffers.items() if b is not None})

    def parameters(self):
        return [u.master for u in self.trained]

    def queue_end_of_backward(self):  # once per backward pass, from inside it
        if (task := torch._C._current_graph_task_id()) != self.task:
            self.task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self):
        """Reduce what no post-backward has (units whose inputs needed no gradient, the root), add every reduction
        to the masters' .grad (with offload: copied to pinned host memory, then one wait) and free every unit."""
        self.task = None
        for u in self.all_units:
            if u.in_backward or any(s.full.grad is not None for s in u.adapters):
                u.post_backward()
        self._finish_reduction()
        if self.offload and self.side_stream is not None:
            self.side_stream.synchronize()  # the host reads these gradients next
        for u, grad in self.arrived:
            u.master.grad = grad if u.master.grad is None else u.master.grad.add_(grad)
        self.arrived = []
        self.reshard()

    def reduce(self, unit, grads):
        """Issue unit's reduce-scatter: its gradients, fp32, chunk-cat in one op into (world, master numel), row
        r in the layout of rank r's master, summed over ranks (then divided: the mean). One in flight at a time."""
        self._finish_reduction()
        with torch.no_grad(), torch.profiler.record_function("fsdp::reduce_scatter"):
            send = torch.empty(self.world, unit.master.numel(), dtype=torch.float32, device=self.device)
            torch._chunk_cat([g.reshape(-1) for g in grads], dim=0, num_chunks=self.world, out=send)
            out = torch.empty(unit.master.numel(), dtype=torch.float32, device=self.device)
            self.pending = (unit, _collective(out, send.view(-1), self.group, reduce_scatter=True), out, send)

    def _finish_reduction(self):  # wait for the reduce-scatter in flight; its gradient shard, to add at the end
        if self.pending is not None:
            (unit, work, grad, _), self.pending = self.pending, None  # its input (send) was kept alive until now
            self.wait(work, "fsdp::wait_reduce_scatter")
            grad.div_(self.world)  # the sum over ranks -> their mean, as FSDP2's gradients
            # with offload, to the host as soon as it is reduced (all added after one wait)
            self.arrived.append((unit, _to_host(grad, self.side_stream) if self.offload and grad.is_cuda else grad))

    def _now(self):  # a point in time: a CUDA event on the compute stream, or the host's clock
        if self.side_stream is None:
            return time.perf_counter()
        (event := torch.cuda.Event(enable_timing=True)).record()
        return event

    def wait(self, work, label):
        """Wait for a collective (all-gathers: side stream). On CUDA the host does not block (nor does
        NCCL's wait()): the compute stream waits, timed by events on it; on the CPU the host waits."""
        with torch.profiler.record_function(label):
            start = self._now()
            if work is not None:  # NCCL: the compute stream waits for the collective, and so for what came before
                work.wait()  # it on its stream (the shard's copy to the GPU, the masters' cast)
            elif self.side_stream is not None:  # no process group: the "collective" was a copy on the side stream
                torch.cuda.current_stream(self.device).wait_stream(self.side_stream)
            self.waits.append((start, self._now()))

    def take_comm_wait_s(self):  # seconds waited on collectives since the last call (the device synchronized)
        s, self.waits = sum(b - a if isinstance(a, float) else a.elapsed_time(b) / 1000 for a, b in self.waits), []
        return s

    def clip_grad_norm_(self, max_norm):
        """torch.nn.utils.clip_grad_norm_ over the whole model: each rank's squared norm of its shards
        (padding is 0), summed over ranks, gives the global L2 norm that scales every shard."""
        sq = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None]).square()
        if dist.is_initialized():
            dist.all_reduce(sq := sq.to(self.device), group=self.group)
        torch.nn.utils.clip_grads_with_norm_(self.parameters(), max_norm, norm := sq.sqrt())
        return norm

    def reshard(self):  # free every unit still gathered
        for u in self.all_units:
            u.free()

    # ---- the state in full, for checkpoints: collectives, every rank gets (or gives) all of it --
    def full_adapters(self, of=None):
        """{name: full fp32 tensor, on the host} of every trainable tensor, gathered from its unit's master or
        from of(master), a tensor laid out like it (its gradient, an AdamW moment)."""
        full = {}
        for u in self.trained:
            flat = u.master if of is None else of(u.master)
            out = torch.empty(self.world * flat.numel(), dtype=torch.float32, device=self.device)
            work = _collective(out, flat.detach().to(self.device, torch.float32), self.group)
            if work is not None:
                work.wait()
            out = out.view(self.world, -1)  # (world, master numel): a tensor's pieces in its columns
            full.update({s.name: out[:, s.start:s.start + s.shard_numel].reshape(-1)[:s.numel].view(s.shape).cpu()
                         for s in u.adapters})
        return full

    def load_full(self, fqn, tensor, of=None):
        """Keep this rank's piece of one full parameter, given in the model's form (an NF4 weight as
        an NF4Tensor); a trainable one's goes into its master, or into of(master) (an AdamW moment)."""
        unit, p = self.param_of[fqn]
        if of is None:
            return p.keep(tensor)
        of(unit.master)[(s := p.slots[0]).start:s.start + s.shard_numel].copy_(s.piece(tensor))

    def full_base(self):
        """(name, full tensor) of every frozen parameter, in order, one unit gathered at a time: a tensor's memory is
        freed with its unit (clone it to keep it)."""
        for u in self.all_units:
            if frozen := [p for p in u.params if not p.trainable]:
                u.gather()
                yield from ((p.fqn, p.value) for p in frozen)
                u.free()

    def base_shapes(self):  # of every frozen parameter, by its name in the model (a Hugging Face checkpoint's)
        return {fqn: p.shape for fqn, (_, p) in self.param_of.items() if not p.trainable}

    def adapter_shapes(self):
        return {s.name: s.shape for u in self.all_units for s in u.adapters}

    def local_bytes(self):  # kept between steps: shard bytes + fp32 masters
        return sum(u.shard_bytes.nbytes + (u.master.nbytes if u.master is not None else 0) for u in self.all_units)

class OffloadedInputs(torch.autograd.graph.saved_tensors_hooks):
    """While active, the saved tensor that is the input given to `start` -- a checkpointed block's input, all that
    checkpointing keeps of it -- waits in host memory (pinned, copied on `stream`) for the block's recompute. The
    copy out starts before the block runs (a compiled block saves its input only once its forward is queued), the
    copy back of the block before's as this one's backward begins: both overlap compute."""

    def __init__(self, stream=None):
        self.stream, self.input, self.host, self.last = stream, None, None, None
        super().__init__(self._pack, self._unpack)

    def start(self, x):  # the next block's input (None: no more blocks): copy it to the host now; -> the hooks
        self.input, self.host = x, None if x is None else _to_host(x, self.stream)
        self.last = None if x is None else self.last  # no more blocks: the chain of packed inputs ends
        return self

    def _pack(self, t):
        x = self.input
        if x is None or t.shape != x.shape or t.data_ptr() != x.data_ptr():
            return t  # not a block input (RoPE's cos and sin): kept as is
        self.last = [t.device, self.host, None, self.last]  # its place, its host copy, back on it, the one before
        return self.last

    def _fetch(self, packed):  # issue the copy back of a packed block input, once, into the compute stream's memory
        if packed is not None and packed[2] is None:
            back, done = torch.empty(packed[1].shape, dtype=packed[1].dtype, device=packed[0]), None
            with _side(self.stream):
                back.copy_(packed[1], non_blocking=True)
                if self.stream is not None:  # what the compute stream waits for: this copy, not the next one's
                    (done := torch.cuda.Event()).record()
            packed[2] = back, done

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        self._fetch(packed)
        self._fetch(packed[3])  # the block before's, for its backward, next
        (t, done), packed[2], packed[3] = packed[2], None, None
        if done is not None:
            torch.cuda.current_stream(t.device).wait_event(done)
        return t

# -----------------------------------------------------------------------------
# 6. AdamW on torch._foreach_* ops
# -----------------------------------------------------------------------------
# Needs: import math, torch.
# torch.optim.AdamW over FSDP2's DTensors pays Python + DTensor dispatch per tensor per op; FSDP above hands over
# one flat shard per unit (Llama-2-7B: 32 tensors, not 448), one foreach call each (decoupled weight decay):
#   p <- p (1 - lr wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
#   p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
# On the CPU these 7 passes over p, g, m, v take a cache-sized chunk of tensors at a time, so later passes find
# them in cache; on a GPU all tensors form one chunk: one kernel launch per pass.
ADAM_CHUNK_BYTES = {"cpu": 1 << 20}  # bytes of parameters per chunk; absent: one chunk
# torch.optim.AdamW's other keywords, at their defaults: what this AdamW implements (foreach may also be True)
TORCH_ADAMW = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                   decoupled_weight_decay=True)

class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW on torch._foreach_* ops, equal to it up to floating-point rounding: torch's keywords at their
    defaults (TORCH_ADAMW; others refused, named), its state_dicts both ways, a tensor lr; no sparse or complex."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **torch_keywords):
        for key in sorted(set(torch_keywords) - set(TORCH_ADAMW))[:1]:
            raise TypeError(f"AdamW got an unexpected keyword argument {key!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      **{**TORCH_ADAMW, **torch_keywords}))
        for group in self.param_groups:
            self._check(group)

    @staticmethod
    def _check(group):  # at construction, and at each step (a loaded state_dict's groups)
        for key, default in TORCH_ADAMW.items():
            value = group.setdefault(key, default)
            if value != default and not (key == "foreach" and value) and not (key == "fused" and value is False):
                raise ValueError(f"AdamW: {key}={value!r} is not implemented here (torch.optim.AdamW has it)")

    @torch.no_grad()
    def step(self, closure=None):  # closure: as every torch.optim optimizer takes it
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            self._check(group)
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse or p.is_complex() for p in params):
                raise RuntimeError("AdamW does not support sparse gradients or complex parameters")
            # [(step count, params)]: runs of ~ADAM_CHUNK_BYTES of params that share their step count (one that had no
            # gradient at some step has fewer)
            chunks, nbytes = [], math.inf
            for p in params:
                if not self.state[p]:
                    self.state[p] = dict(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                self.state[p]["step"] = int(self.state[p]["step"]) + 1  # torch's state_dict: a tensor
                if nbytes >= ADAM_CHUNK_BYTES.get(p.device.type, math.inf) or self.state[p]["step"] != chunks[-1][0]:
                    chunks, nbytes = chunks + [(self.state[p]["step"], [])], 0
                chunks[-1][1].append(p)
                nbytes += p.nbytes
            lr, beta1, beta2, eps, wd = map(float, (group["lr"], *group["betas"], group["eps"], group["weight_decay"]))
            for step, chunk in chunks:
                c1, c2 = 1 - beta1**step, math.sqrt(1 - beta2**step)  # bias corrections of m and sqrt(v)
                grads = [p.grad for p in chunk]
                exp_avgs, exp_avg_sqs = ([self.state[p][k] for p in chunk] for k in ("exp_avg", "exp_avg_sq"))
                if wd != 0:
                    torch._foreach_mul_(chunk, 1 - lr * wd)
                torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
                # c2 folded into the constants, one pass fewer: m / (sqrt(v) / c2 + eps) = c2 m / (sqrt(v) + eps c2)
                denom = torch._foreach_sqrt(exp_avg_sqs)
                torch._foreach_add_(denom, eps * c2)
                torch._foreach_addcdiv_(chunk, exp_avgs, denom, -lr * c2 / c1)
        return loss

# -----------------------------------------------------------------------------
# 7. Llama, module for module as Hugging Face's LlamaForCausalLM
# -----------------------------------------------------------------------------
# Needs: import contextlib, math, torch, torch.nn as nn, torch.nn.functional as F; from dataclasses import dataclass;
# from typing import Optional; from torch.utils.checkpoint import checkpoint; from above: NF4Tensor, NF4Linear,
# LoRALinear, use_compiled.

@dataclass
class LlamaConfig:  # field names are Hugging Face config.json's
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None  # None: as many as attention heads (no GQA)
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # Llama 3.1: {"rope_type": "llama3", "factor": 8.0, ...}
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.num_key_value_heads is None:  # no GQA: as many kv heads as heads
            self.num_key_value_heads = self.num_attention_heads

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

# One line per size (Llama 2: Touvron et al. 2023; Llama 3: Meta 2024). `small`: the smallest shapes
# torchao's NF4 can also shard over 2 ranks, to compare against it.
CONFIGS = {  # vocab_size, hidden_size, intermediate_size, layers, heads, kv heads, context (theta: keyword)
    "tiny": LlamaConfig(256, 128, 384, 4, 4, 2, 1024),
    "small": LlamaConfig(256, 256, 768, 4, 4, 4, 1024),
    "llama2-7b": LlamaConfig(32000, 4096, 11008, 32, 32, 32, 4096),
    "llama2-13b": LlamaConfig(32000, 5120, 13824, 40, 40, 40, 4096),
    "llama2-70b": LlamaConfig(32000, 8192, 28672, 80, 64, 8, 4096),
    "llama3-8b": LlamaConfig(128256, 4096, 14336, 32, 32, 8, 8192, rope_theta=500000.0),
    "llama3-70b": LlamaConfig(128256, 8192, 28672, 80, 64, 8, 8192, rope_theta=500000.0),
}

class RMSNorm(nn.Module):
    def __init__(self, dim, eps, dtype):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x):  # normalize in fp32, scale in the compute dtype (as Hugging Face)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

def rope_inv_freq(config):
    """theta^(-2i/d) for i < d/2, with Llama 3.1's frequency-dependent scaling if configured."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = config.rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) == "llama3":
        factor, low, high = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_len, wavelen = rs.get("original_max_position_embeddings", 8192), 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq.float()

def rope_cos_sin(config, T, device, dtype):
    """cos, sin of shape (T, head_dim) in Hugging Face's layout: the frequencies twice."""
    inv_freq = rope_inv_freq(config).to(device)
    freqs = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)  # (T, d/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, d)
    return emb.cos().to(dtype), emb.sin().to(dtype)

def apply_rope(x, cos, sin):  # x (B, n_heads, T, head_dim); rotate_half splits the head in two
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin

class LlamaAttention(nn.Module):
    def __init__(self, c, lora):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = LoRALinear(c.hidden_size, self.n_heads * self.head_dim, **lora)
        self.k_proj = LoRALinear(c.hidden_size, self.n_kv * self.head_dim, **lora)
        self.v_proj = LoRALinear(c.hidden_size, self.n_kv * self.head_dim, **lora)
        self.o_proj = LoRALinear(self.n_heads * self.head_dim, c.hidden_size, **lora)

    def forward(self, x, cos, sin):  # x (B, T, C)
        B, T, C = x.shape
        q, k, v = LoRALinear.shared_input(x, self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, nh or nkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # grouped-query attention: each of the nkv heads serves nh / nkv query heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))

class LlamaMLP(nn.Module):
    def __init__(self, c, lora):
        super().__init__()
        self.gate_proj = LoRALinear(c.hidden_size, c.intermediate_size, **lora)
        self.up_proj = LoRALinear(c.hidden_size, c.intermediate_size, **lora)
        self.down_proj = LoRALinear(c.intermediate_size, c.hidden_size, **lora)

    def forward(self, x):  # SwiGLU (Shazeer 2020)
        gate, up = LoRALinear.shared_input(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)

class LlamaDecoderLayer(nn.Module):
    def __init__(self, c, lora):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, lora["dtype"])
        self.self_attn = LlamaAttention(c, lora)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, lora["dtype"])
        self.mlp = LlamaMLP(c, lora)

    def forward(self, x, cos, sin, checkpointing=False):
        if checkpointing and torch.is_grad_enabled():
            # Keep only the block's input (B, T, C), recompute the rest in backward; inside forward, so that
            # compiled, the recompute fuses into backward's kernels
            return checkpoint(self.block, x, cos, sin, use_reentrant=False)
        return self.block(x, cos, sin)

    def block(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

IGNORE_INDEX = -100  # a target that does not count (F.cross_entropy's default ignore_index)

def _cross_entropy_rows(logits, targets, need_grad: bool):
    """logits (n, V), targets (n,) -> (the sum of the counted rows' losses, fp32; and if need_grad its gradient wrt
    the logits, softmax - onehot, zero on ignored rows, in logits' dtype). Eager: in place on one fp32 copy of the
    logits, the one-hot made as bool; compiled, the passes fuse (max, sum of exp, gradient), neither is made."""
    keep = (targets != IGNORE_INDEX)[:, None]  # (n, 1)
    t = targets.masked_fill(targets == IGNORE_INDEX, 0)[:, None]  # ignored rows look up class 0, count 0
    x = logits.float()
    target_logit = x.gather(1, t)
    m = x.amax(dim=-1, keepdim=True)
    sumexp = x.sub_(m).exp_().sum(dim=-1, keepdim=True)  # x now holds exp(l - max)
    loss = torch.where(keep, m + sumexp.log() - target_logit, 0.0).sum()
    if not need_grad:
        return loss, None
    onehot = torch.arange(x.shape[1], device=x.device) == t  # (n, V)
    return loss, x.div_(sumexp).add_(onehot, alpha=-1).mul_(keep).to(logits.dtype)

_cross_entropy_rows_compiled = torch.compile(_cross_entropy_rows, dynamic=True)

class _ChunkedCrossEntropy(torch.autograd.Function):
    """Cross entropy of h W^T against targets, `chunk` rows at a time (the sum over the counted targets, or their
    mean). Full logits for Llama-2-7B at T=2048 are 131 MB per sequence in bf16, and as many for their gradient;
    here one chunk's at a time: forward computes each chunk's loss AND its gradient wrt h, (softmax - onehot) W,
    and backward just scales it (no gradient for the weight: lm_head is frozen)."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, reduction, compile):  # h (N, C), weight (V, C), targets (N,)
        W = weight.dequantize(h.dtype, compile) if isinstance(weight, NF4Tensor) else weight.to(h.dtype)
        need_grad = ctx.needs_input_grad[0]
        rows = _cross_entropy_rows_compiled if use_compiled(compile, h) else _cross_entropy_rows
        grad_h = torch.empty_like(h) if need_grad else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            loss, grad_logits = rows(h[s:s + chunk] @ W.T, targets[s:s + chunk], need_grad)  # (n, V)
            total += loss
            if need_grad:
                torch.mm(grad_logits, W, out=grad_h[s:s + chunk])  # (n, C), not (n, V)
            del grad_logits  # before the next chunk's logits are made: one chunk alive, not two
        # "mean": over the counted targets; none counted gives 0, not 0/0
        ctx.denominator = (targets != IGNORE_INDEX).sum().clamp(min=1) if reduction == "mean" else 1
        ctx.save_for_backward(grad_h)
        return total / ctx.denominator

    @staticmethod
    def backward(ctx, grad_loss):
        return ctx.saved_tensors[0] * (grad_loss / ctx.denominator).to(ctx.saved_tensors[0].dtype), *[None] * 5

LOSS_CHUNK = 1024  # rows of logits alive at once in the loss

def chunked_cross_entropy(h, weight, targets, chunk=LOSS_CHUNK, reduction="mean", compile=None):
    """F.cross_entropy(h @ weight.T, targets, ignore_index=IGNORE_INDEX, reduction=reduction) for reduction "mean"
    or "sum", without the full logits; a mean over no target is 0; a target out of [0, vocab) raises."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    # a target outside [0, vocab) is an error, as in F.cross_entropy; the compiled kernel's own check could abort
    torch._assert_async(((targets >= 0) & (targets < weight.shape[0]) | (targets == IGNORE_INDEX)).all(),
                        "chunked_cross_entropy: a target is outside [0, vocab) and not IGNORE_INDEX")
    return _ChunkedCrossEntropy.apply(h, weight, targets, chunk, reduction, compile)

class LMHead(NF4Linear):
    """lm_head: the logits, or given targets the chunked cross entropy (never all the logits at once)."""

    def forward(self, h, targets=None, reduction="mean"):  # h (B, T, C), targets (B, T)
        if targets is None:
            return super().forward(h)  # (B, T, vocab)
        return chunked_cross_entropy(h.flatten(0, -2), self.weight, targets.reshape(-1), reduction=reduction,
                                     compile=self.compile)

class Llama(nn.Module):
    """LlamaForCausalLM with every projection a LoRALinear over NF4 and an NF4 lm_head; compile: the NF4
    kernels' and the loss's (section 2)."""

    def __init__(self, config, dtype=torch.bfloat16, lora_rank=8, lora_alpha=16.0, lora_dropout=0.0, compile=None):
        super().__init__()
        self.config, self.dtype = config, dtype
        self.checkpointing = True  # activation checkpointing per block
        self.offload_activations = None  # an OffloadedInputs: each block's saved input on the host
        lora, c = dict(rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout, dtype=dtype, compile=compile), config
        self.model = nn.Module()  # a container that gives Hugging Face's "model." names; forward runs it
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype).requires_grad_(False)
        self.model.layers = nn.ModuleList(LlamaDecoderLayer(c, lora) for _ in range(c.num_hidden_layers))
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = LMHead(c.hidden_size, c.vocab_size, dtype=dtype, compile=compile)

    def forward(self, tokens, targets=None, reduction="mean"):  # tokens, targets (B, T) int64
        """Logits (B, T, vocab); with targets, the cross entropy over the targets that count
        (!= IGNORE_INDEX): their mean, or with reduction="sum" their sum."""
        T = tokens.shape[1]
        h = self.model.embed_tokens(tokens)  # (B, T, C)
        cos, sin = rope_cos_sin(self.config, T, tokens.device, h.dtype)
        # With offload each checkpointed block input waits in host memory until the block's backward.
        offload = self.offload_activations if self.checkpointing and torch.is_grad_enabled() else None
        for layer in self.model.layers:
            with offload.start(h) if offload else contextlib.nullcontext():
                h = layer(h, cos, sin, self.checkpointing)
        if offload:
            offload.start(None)  # so the hooks don't keep the last block's input alive
        return self.lm_head(self.model.norm(h), targets, reduction)

    def units(self):  # FSDP's units, in execution order: the embeddings, each block, the norm with lm_head
        return [self.model.embed_tokens, *self.model.layers, [self.model.norm, self.lm_head]]

# -----------------------------------------------------------------------------
# 8. Predicting the peak: every buffer of a training step, counted from the pieces above
# -----------------------------------------------------------------------------
# Needs: import math; from above: GiB, NF4_BITS_PER_PARAM, count_params, linear_shapes, ADAM_CHUNK_BYTES,
# LOSS_CHUNK.
# Section 1 counted the state that lives between steps. A step adds the all-gather buffers of section 5 and the
# activations autograd keeps for backward, whose peak comes in the loss or in the first block backward runs:
# every checkpointed block input is alive, plus the loss or that block.

# cuBLAS's workspace (its Lt shares it), through the caching allocator: 32 MiB on Hopper (4096 KiB x 8; less on
# older GPUs), one for each thread that runs matmuls: forward's and autograd's backward thread.
CUDA_WORKSPACES = 2 * 32 * 2**20

def estimate_memory(config, world=1, batch_size=8, seq_len=2048, dtype_bytes=2, lora_rank=8,
                    checkpointing=True, offload=False, loss_chunk=LOSS_CHUNK, offload_activations=False, compiled=True):
    """Predicted bytes per rank of a QLoRA training step as this file runs it (compiled: with --compile). Sharded
    state is 1/world of the whole; activations are for one rank's batch_size x seq_len tokens, op by op."""
    c, elt, tokens = config, dtype_bytes, batch_size * seq_len
    d, ffn, vocab, layers = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_hidden_layers
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    linear, head, dense, lora = count_params(config, lora_rank)
    nf4 = lambda n: n * NF4_BITS_PER_PARAM / 8  # noqa: E731  (bytes of n NF4 weights)
    state = {  # sharded, resident between steps (on the host with offload)
        "NF4 weights (shard)": nf4(linear + head) / world,
        "frozen dense weights (shard)": dense * elt / world,
        "adapters fp32 + wire copy (shard)": lora * (4 + elt) / world,
        "adapter gradients fp32 (shard)": 4 * lora / world,
        # m and v (AdamW's sqrt(v) lives only during its step, when backward's buffers are gone)
        "AdamW state fp32 (shard)": 8 * lora / world}
    # All-gathers: two block units at a time, the one being computed and the next one's receive buffer (prefetched
    # after the copy-out, whose receive buffer is gone by then).
    gathers = 2 * (block_unit := nf4(linear / layers) + 2 * d * elt + (lora / layers) * elt)
    # Saved by one block for backward, bytes per token, op by op: each RMSNorm its fp32 input and its output (the
    # LoRA A of the projections it feeds); attention its RoPE'd q and k, v, its output and an fp32 log-sum-exp per
    # head; o_proj's LoRA its input (a reshaped copy); SwiGLU the gate, both factors of the product and the product
    # (down_proj's LoRA); each projection's (rank,) LoRA intermediate. The NF4 linears save only their packed
    # weight (in the all-gather buffers); RoPE's cos and sin, (T, head_dim) for all blocks, are not counted.
    norms = 2 * (4 * d + elt * d)
    attention = elt * (3 * q_dim + 2 * kv_dim) + 4 * c.num_attention_heads
    mlp = elt * 4 * ffn
    block_saved = norms + attention + mlp + 7 * elt * lora_rank
    # Backward frees each saved tensor once its op's backward is done, so beside them there is about one
    # (tokens, ffn) gradient and one (tokens, d) at a time; and, not per token, the dense weight inside the
    # NF4 matmul that runs (the largest projection's), the block's adapter gradients and the unit before's
    # reduce-scatter input and output (fp32), alive until this unit's is issued (section 5).
    block_backward = elt * (ffn + d) + 4 * q_dim  # and attention's backward accumulates in fp32 (flash)
    in_flight = elt * max(o * i for o, i in linear_shapes(c).values()) + lora / layers * (elt + 4 + 4 / world)
    act = {}
    if checkpointing:
        if offload_activations:  # kept on the host; the block's and the next one's (prefetched) on the GPU
            act["checkpointed block inputs (host)"] = layers * tokens * elt * d
            act["checkpointed block inputs back on the GPU (2)"] = kept = 2 * tokens * elt * d
        else:
            act["checkpointed block inputs"] = kept = layers * tokens * elt * d
        act["recomputed block (forward + backward)"] = block = tokens * (block_saved + block_backward) + in_flight
    else:
        act["saved activations, all blocks"] = kept = layers * tokens * block_saved
        act["block backward gradients"] = block = tokens * block_backward + in_flight
    # The loss: the final norm's saved tensors, lm_head dequantized, one chunk of logits and, compiled, their
    # gradient; eager, at its peak, the fp32 copy of bf16 logits and the one-hot (bool, and cast to fp32) instead;
    # and the gradient wrt the hidden states.
    per_logit = 2 * elt if compiled else elt + 4 * (elt != 4) + 1 + 4
    act["loss: norm, lm_head dense, logits chunk, grad_h"] = loss = (
        tokens * (4 * d + elt * d) + vocab * d * elt + min(loss_chunk, tokens) * vocab * per_logit + tokens * d * elt)
    # The loss's buffers are gone before the blocks' backward, where the incoming gradient (tokens x d) joins.
    act_peak, gpu_state = kept + max(block + tokens * d * elt, loss), 0 if offload else sum(state.values())
    # Loading streams one weight at a time: the largest, dense in the compute dtype, and its NF4.
    largest = max(vocab * d, d * ffn, d * q_dim)
    load_peak = gpu_state + largest * (elt + NF4_BITS_PER_PARAM / 8)
    # Host memory. CUDA's pinned allocator (what the GPU copies from and to without blocking) rounds each
    # allocation up to a power of two: each unit's shard, its fp32 master adapters and their gradient, each
    # offloaded block input. AdamW's moments (and its sqrt(v), one ADAM_CHUNK_BYTES chunk at a time) are pageable.
    pinned = lambda n: 2 ** math.ceil(math.log2(n)) if n >= 1 else 0  # noqa: E731
    host = layers * pinned(tokens * elt * d) if checkpointing and offload_activations else 0
    if offload:  # the shards of the embeddings, of norm + lm_head and of each block (+ its masters, gradients)
        unit = pinned(block_unit / world) + 2 * pinned(4 * lora / layers / world)
        host += pinned(vocab * d * elt / world) + pinned((nf4(head) + d * elt) / world) + 8 * lora / world + (
            ADAM_CHUNK_BYTES["cpu"] + layers * unit)
    return dict(state=state, gathers=gathers, activations=act, activation_peak=act_peak, gpu_state=gpu_state,
                host_state=host, gpu_peak=gpu_state + gathers + act_peak + CUDA_WORKSPACES, load_peak=load_peak)

def format_estimate(name, est, world, offload):
    where = "host" if offload else "GPU"
    rows = [(f"{k} ({where})", v) for k, v in est["state"].items()]
    rows += [("all-gather buffers (1 gathered + 1 receiving)", est["gathers"]), *est["activations"].items(),
             ("CUDA workspaces (cuBLAS, 2 threads)", CUDA_WORKSPACES), ("predicted peak per GPU", est["gpu_peak"]),
             ("while loading (one weight at a time), per GPU", est["load_peak"])]
    if est["host_state"] > 0:
        rows.append(("predicted host memory for offloaded tensors", est["host_state"]))
    title = f"predicted memory per rank, {name}, world {world}" + (", state offloaded to the host" if offload else "")
    return "\n".join([title + ":"] + [f"  {k:<48} {v / GiB:8.3f} GiB" for k, v in rows])

# -----------------------------------------------------------------------------
# 9. Hugging Face checkpoints: safetensors in and out, PEFT adapters, resumable state
# -----------------------------------------------------------------------------
# Needs: import io, itertools, json, math, os, re, shutil, numpy as np, torch, torch.distributed as dist; from
# dataclasses import fields; from above: seeded, random_weight, lora_A_init, linear_shapes, LlamaConfig, Llama.
# safetensors: an 8-byte little-endian header length N, N bytes of JSON
#   {"name": {"dtype": "BF16", "shape": [out, in], "data_offsets": [begin, end]}, "__metadata__": {...}}
# then the raw little-endian bytes, offsets relative to the end of the header.

class UserError(Exception):
    """Bad input (a file, a flag): main() prints it as one line and exits non-zero."""

def require(ok, message):
    if not ok:
        raise UserError(message)

def print0(*args, **kwargs):  # rank 0 speaks for all
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)

SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}

def read_json(path, raw=None, what="file"):
    """The JSON object in file `path`, or in `raw` (bytes read from it)."""
    if raw is None:
        require(os.path.isfile(path), f"{path}: no such file")
        with open(path, "rb") as f:
            raw = f.read()
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: {what} is not valid JSON ({getattr(e, 'msg', e)})")
    require(isinstance(obj, dict), f"{path}: {what} is not a JSON object")
    return obj

class SafetensorsFile:
    """The header of one .safetensors file, every offset checked before a byte is read:
    entries {name: (dtype, shape, begin, end)}; get(name) reads one tensor."""

    def __init__(self, path):
        require(os.path.isfile(path), f"{path}: no such file")
        self.path, size = path, os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")  # a file under 8 bytes fails the next check too
            require(8 + n <= size, f"{path}: header length {n} runs past the end of the file ({size} bytes)")
            header = read_json(path, f.read(n), what="header")
        header.pop("__metadata__", None)  # free-form strings, not a tensor
        self.data_start, data_size = 8 + n, size - 8 - n
        self.entries = {}
        for name, e in header.items():
            where = f"{path}: tensor {name}"
            try:
                dtype, shape, (begin, end) = e["dtype"], [int(d) for d in e["shape"]], map(int, e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise UserError(f"{where}: malformed header entry")
            require(dtype in SAFETENSORS_DTYPES, f"{where}: unsupported dtype {dtype}")
            require(0 <= begin <= end <= data_size, f"{where}: offsets [{begin}, {end}] run past the end of the "
                                                    f"data ({data_size} bytes): truncated file?")
            require(end - begin == math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize,
                    f"{where}: {end - begin} bytes for shape {shape} {dtype}")
            self.entries[name] = (SAFETENSORS_DTYPES[dtype], shape, begin, end)
        spans = sorted((begin, end, name) for name, (_, _, begin, end) in self.entries.items())
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            require(begin >= end, f"{path}: tensors {a} and {b} overlap in the file")

    def get(self, name):
        dtype, shape, begin, end = self.entries[name]
        raw = np.fromfile(self.path, np.uint8, end - begin, offset=self.data_start + begin)  # memory of its own
        require(raw.size == end - begin, f"{self.path}: tensor {name} is cut short (the file shrank?)")
        return torch.from_numpy(raw).view(dtype).view(shape) if raw.size else torch.empty(shape, dtype=dtype)

def atomic_write(path, write, mode="wb"):
    """write(f) into path.tmp, then rename: readers see the old file or the new one, never half of one."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a full disk, a directory in the way
        if os.path.isfile(tmp):
            os.remove(tmp)
        raise UserError(f"{path}: cannot be written ({getattr(e, 'strerror', None) or type(e).__name__})")

def save_safetensors(path, specs, get):
    """Write tensors to `path` one at a time (atomically): specs [(name, dtype, shape)], get(name) -> tensor."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0  # "pt": what transformers' loader asks of a file
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned

    def write(f):
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, dtype, shape in specs:
            t = get(name).detach().to("cpu", dtype, copy=True).contiguous()  # never export our storage
            assert tuple(t.shape) == tuple(shape), name
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    atomic_write(path, write)

def config_from_hf(d, where="config.json"):
    """LlamaConfig from a Hugging Face config.json dict (transformers 4 or 5 layout), every field this file
    uses checked for its type and range (JSON's true is no count)."""
    require(d.get("model_type") == "llama" or any("Llama" in a for a in d.get("architectures") or []),
            f"{where}: model_type is {d.get('model_type')!r}, not a Llama")
    kwargs = {f.name: d[f.name] for f in fields(LlamaConfig) if d.get(f.name) is not None}
    rope = d.get("rope_parameters")  # transformers 5: RoPE settings moved under one key
    require(isinstance(rope, (dict, type(None))), f"{where}: rope_parameters must be an object")
    if rope:
        kwargs["rope_theta"] = rope.get("rope_theta", kwargs.get("rope_theta", 10000.0))
        kwargs["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else kwargs.get("rope_scaling")
    count = lambda x: type(x) is int and x >= 1  # noqa: E731
    positive = lambda x: type(x) in (int, float) and math.isfinite(x) and x > 0  # noqa: E731
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        require(count(kwargs.get(key)), f"{where}: {key} is missing or not a positive integer")
    c = LlamaConfig(**kwargs)
    scaling = c.rope_scaling if isinstance(c.rope_scaling, dict) else {"rope_type": "default"}
    rope_type = scaling.get("rope_type", scaling.get("type"))  # "type": older transformers
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)  # Meta's defaults
    kv_dim = c.num_key_value_heads * c.head_dim if count(c.num_key_value_heads) else 0
    for ok, what in [  # in order: the first that fails is the error
            (count(c.max_position_embeddings), "max_position_embeddings must be a positive integer"),
            (type(c.tie_word_embeddings) is bool, f"tie_word_embeddings must be true or false, not "
                                                  f"{c.tie_word_embeddings!r}"),
            (c.hidden_size % c.num_attention_heads == 0 and d.get("head_dim", c.head_dim) == c.head_dim,
             "head_dim must be hidden_size / num_attention_heads"),
            (isinstance(c.rope_scaling, (dict, type(None))), "rope_scaling must be an object"),
            (rope_type in ("llama3", "default"), f"rope_scaling type {rope_type!r} is not supported"),
            (rope_type != "llama3" or positive(scaling.get("factor")), "llama3 rope_scaling needs a positive factor"),
            (rope_type != "llama3" or positive(low) and positive(high) and low < high and count(scaling.get(
                "original_max_position_embeddings", 8192)), "llama3 rope_scaling needs positive low_freq_factor < "
                "high_freq_factor and a positive integer original_max_position_embeddings"),
            (positive(c.rms_norm_eps), "rms_norm_eps must be a positive number"),
            (positive(c.rope_theta), "rope_theta must be a positive number"),
            (kv_dim and c.num_attention_heads % c.num_key_value_heads == 0,
             "num_key_value_heads must divide num_attention_heads"),
            (all(c.hidden_size * n % 64 == 0 for n in (c.hidden_size, kv_dim, c.intermediate_size, c.vocab_size)),
             "every weight's size must be a multiple of 64 (NF4's block)")]:
        require(ok, f"{where}: {what}")
    return c

def config_to_hf(config, dtype):
    d = {f.name: getattr(config, f.name) for f in fields(LlamaConfig)}
    d.update(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype=str(dtype).split(".")[-1],
             hidden_act="silu", attention_bias=False, mlp_bias=False, head_dim=config.head_dim)
    return {k: v for k, v in d.items() if v is not None}

def hf_shapes(config, layer=None):
    """{name: shape} config.json implies for a Hugging Face Llama checkpoint: block `layer`'s tensors, or with
    none the others (the embeddings, the final norm, lm_head)."""
    d = config.hidden_size
    if layer is None:
        return {"model.embed_tokens.weight": (config.vocab_size, d), "model.norm.weight": (d,),
                "lm_head.weight": (config.vocab_size, d)}
    return {f"model.layers.{layer}.{n}.weight": s for n, s in
            {"input_layernorm": (d,), "post_attention_layernorm": (d,), **linear_shapes(config)}.items()}

def load_checkpoint(path, config):
    """((name, full tensor) of every weight of the Hugging Face directory `path`, read one at a time; their bytes).
    Every header is checked against config.json at once: a mismatch is refused before anything of its size exists."""
    names = ["model.safetensors"]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        require(isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values()),
                f"{index}: not a safetensors index (no weight_map of file names)")
        for name, file in weight_map.items():  # a plain file name: nothing outside the checkpoint is read
            require(os.path.basename(file) == file and file not in ("", ".", "..") and "/" not in file,
                    f"{index}: entry {name} names {file!r}, not a file in the checkpoint directory")
        names = list(dict.fromkeys(weight_map.values()))
    # name -> (file, its name there); old checkpoints also store RoPE's constants, rotary_emb.inv_freq
    files = [SafetensorsFile(os.path.join(path, n)) for n in names]
    sources = {name: (sf, name) for sf in files for name in sf.entries if not name.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings and "lm_head.weight" not in sources and "model.embed_tokens.weight" in sources:
        sources["lm_head.weight"] = sources["model.embed_tokens.weight"]  # tied: the head is the embedding
    layers = config.num_hidden_layers
    for name, (sf, key) in sources.items():
        dtype, shape, _, _ = sf.entries[key]
        i = re.fullmatch(r"model\.layers\.(0|[1-9][0-9]*)\..+", name)
        want = hf_shapes(config, int(i[1]) if i and int(i[1]) < layers else None).get(name)
        require(want is not None, f"{sf.path}: unexpected tensor {name} for a Llama of this config.json")
        require(tuple(shape) == want, f"{sf.path}: tensor {name} has shape {shape}, config.json implies {list(want)}")
        require(dtype.is_floating_point, f"{sf.path}: tensor {name} is {DTYPE_NAMES[dtype]}, not floating point")
    if len(sources) < 3 + 9 * layers:  # every name left is an expected one: count, and name one (never list them)
        first = next(n for i in itertools.chain([None], range(layers)) for n in hf_shapes(config, i)
                     if n not in sources)
        raise UserError(f"{path}: {3 + 9 * layers - len(sources):,} tensors missing from the checkpoint, e.g. {first}")
    nbytes = sum(end - begin for sf, key in sources.values() for _, _, begin, end in [sf.entries[key]])
    return ((name, sf.get(key)) for name, (sf, key) in sources.items()), nbytes

def initial_weights(shapes, seed, device="cpu"):
    """(name, full tensor) of parameters with no checkpoint, as the modules draw them, one at a time, each from a
    seeded generator on `device`: alike at any world size on one kind of device (adapters: on the CPU, alike)."""
    for name, shape in shapes.items():
        if name.endswith("lora_A"):
            yield name, lora_A_init(shape, seeded(seed, name))
        elif name.endswith("lora_B"):  # B = 0: the model starts as the base
            yield name, torch.zeros(shape)
        elif "norm" in name:
            yield name, torch.ones(shape, device=device)
        elif "embed_tokens" in name:  # N(0, 1)
            yield name, torch.randn(shape, generator=seeded(seed, name, device=device), device=device)
        else:  # linears N(0, 1/in)
            yield name, random_weight(shape, seeded(seed, name, device=device))

def from_pretrained(path, dtype=torch.bfloat16, lora_rank=8, lora_alpha=16.0, lora_dropout=0.0, device=None, seed=0):
    """Unsharded: a meta Llama whose parameters are replaced one by one as the checkpoint is read (assign=True;
    NF4Linear quantizes), plus fresh adapters: memory stays near the NF4 size, never a bf16 model."""
    config = config_from_hf(read_json(os.path.join(path, "config.json")), os.path.join(path, "config.json"))
    device, (checkpoint, _) = torch.device(device or "cpu"), load_checkpoint(path, config)  # headers checked
    with torch.device("meta"):
        model = Llama(config, dtype, lora_rank, lora_alpha, lora_dropout)
    load = lambda state: model.load_state_dict(state, strict=False, assign=True)  # noqa: E731
    for name, t in checkpoint:  # one at a time; NF4Linear quantizes its weight
        load({name: t.to(device, dtype)})
    adapters = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
    load({n: t.to(device) for n, t in initial_weights(adapters, seed)})
    return model

Llama.from_pretrained = staticmethod(from_pretrained)  # Llama's (section 7), it needs this section's reader

# PEFT's adapter format: what peft.PeftModel.from_pretrained(base, DIR) loads.
PEFT_PREFIX, TARGET_MODULES = "base_model.model.", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj"]

def save_adapters(out_dir, adapters, args):
    """adapter_model.safetensors (keys base_model.model.<name>.lora_A.weight) + adapter_config.json."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = {PEFT_PREFIX + name + ".weight": t.float() for name, t in adapters.items()}
    save_safetensors(os.path.join(out_dir, "adapter_model.safetensors"),
                     [(k, torch.float32, tuple(t.shape)) for k, t in tensors.items()], tensors.__getitem__)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": args.lora_rank, "lora_alpha": args.lora_alpha,
              "lora_dropout": args.lora_dropout, "target_modules": TARGET_MODULES, "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": args.checkpoint or ""}
    atomic_write(os.path.join(out_dir, "adapter_config.json"), lambda f: json.dump(config, f, indent=2), "w")

def load_adapters(path):
    """{name: tensor} from a PEFT adapter directory (the inverse of save_adapters)."""
    sf = SafetensorsFile(os.path.join(path, "adapter_model.safetensors"))
    return {k[len(PEFT_PREFIX):-len(".weight")]: sf.get(k) for k in sf.entries}

RESUME_MUST_MATCH = ("model", "checkpoint", "lora_rank", "lora_alpha", "lora_dropout", "seed")

def save_checkpoint(out_dir, step, fsdp, optimizer, args):
    """Collective. Rank 0 writes out_dir/checkpoint-<step>/ (adapters + training_state.pt: the step, AdamW's count
    and moments in full {"exp_avg": {name: tensor}, ...}, the flags --resume checks; no RNG state: each step seeds its
    own dropout) under a temporary name, renames it, then points out_dir/latest at it: a crash at any moment leaves
    the previous checkpoint whole and named. The adapters also go in out_dir, where PEFT looks."""
    adapters = fsdp.full_adapters()
    kept = "; its last checkpoint is intact" if os.path.isfile(os.path.join(out_dir, "latest")) else ""
    require(all(t.isfinite().all() for t in adapters.values()),
            f"--out {out_dir}: the adapters hold inf or NaN after step {step}, not saved{kept}")
    moments = {k: fsdp.full_adapters(of=lambda m: optimizer.state[m][k]) for k in ("exp_avg", "exp_avg_sq")}
    adam_step = optimizer.state[fsdp.parameters()[0]]["step"]  # one count: every master steps together
    if fsdp.rank == 0:
        name = f"checkpoint-{step}"
        final, tmp = os.path.join(out_dir, name), os.path.join(out_dir, f".{name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_adapters(tmp, adapters, args)
        state = dict(step=step, adam_step=adam_step, moments=moments, dtype=args.dtype, world_size=fsdp.world,
                     **{k: getattr(args, k) for k in RESUME_MUST_MATCH})
        buffer = io.BytesIO()  # so that a full disk is an OSError of the write, not torch.save's RuntimeError
        torch.save(state, buffer)
        atomic_write(os.path.join(tmp, "training_state.pt"), lambda f: f.write(buffer.getvalue()))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        atomic_write(os.path.join(out_dir, "latest"), lambda f: f.write(name), "w")
        for old in os.listdir(out_dir):  # keep only the newest checkpoint
            if old.startswith("checkpoint-") and old != name:
                shutil.rmtree(os.path.join(out_dir, old), ignore_errors=True)
        save_adapters(out_dir, adapters, args)
    if dist.is_initialized():
        dist.barrier()

def resume(args, fsdp, optimizer):
    """Load the checkpoint --out/latest names into the shards and AdamW; returns its step."""
    latest = os.path.join(args.out, "latest")  # parse_args: --resume needs --out
    require(os.path.isfile(latest), f"--resume: no checkpoint to resume from in --out {args.out}")
    with open(latest) as f:
        path = os.path.join(ckpt := os.path.join(args.out, f.read().strip()), "training_state.pt")
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 -- any unreadable file is the same user error
        raise UserError(f"{path}: cannot be read ({type(e).__name__})")
    require(isinstance(state, dict), f"{path}: not a training state")
    for key in RESUME_MUST_MATCH:
        require(state.get(key) == getattr(args, key),
                f"--resume {ckpt}: saved with --{key} {state.get(key)}, this run has --{key} {getattr(args, key)}")
    adapters, moments, shapes = load_adapters(ckpt), state.get("moments"), fsdp.adapter_shapes()
    fits = lambda d: (isinstance(d, dict) and d.keys() == shapes.keys()  # noqa: E731
                      and all(tuple(d[n].shape) == tuple(shapes[n]) for n in shapes))
    require(fits(adapters) and isinstance(moments, dict) and moments.keys() == {"exp_avg", "exp_avg_sq"}
            and all(map(fits, moments.values())),
            f"--resume {ckpt}: its adapters or AdamW moments are not this model's (an older format?)")
    for name, t in adapters.items():
        fsdp.load_full(name, t)
    for m in fsdp.parameters():
        optimizer.state[m] = dict(step=state["adam_step"], exp_avg=torch.zeros_like(m), exp_avg_sq=torch.zeros_like(m))
    for k, full in moments.items():  # {"exp_avg": {name: full tensor}, "exp_avg_sq": ...}
        for name, t in full.items():
            fsdp.load_full(name, t, of=lambda m: optimizer.state[m][k])
    print0(f"resumed from {args.out} at step {state['step']} (saved by world size {state['world_size']})")
    return state["step"]

def shard_files(specs, max_bytes):
    """[(name, dtype, shape)] cut into files by the rule of Hugging Face's save_pretrained(max_shard_size), in our
    order (readers go by the index): a new file where the next tensor would take this one past max_bytes."""
    files, size = [[]], 0
    for spec in specs:
        n = math.prod(spec[2]) * spec[1].itemsize
        if files[-1] and size + n > max_bytes:
            files, size = files + [[]], 0
        files[-1].append(spec)
        size += n
    return files

def save_merged(out_dir, fsdp, model, source=None, max_shard_bytes=5e9):
    """Collective. A Hugging Face checkpoint of the base with the adapters merged in, W' = W + (alpha/rank) B A, by
    rank 0, unit by unit: model.safetensors, or above max_shard_bytes model-0000k-of-0000n.safetensors and their
    index; then config.json (the `source`'s other keys kept, its token ids) and its generation_config.json."""
    adapters = fsdp.full_adapters()
    base = fsdp.full_base()  # (name, full tensor), unit by unit, in the order of base_shapes()

    def get(name):
        got, w = next(base)
        assert got == name, (got, name)
        w, prefix = w.to(torch.float32), name.removesuffix(".weight")  # an NF4 weight dequantizes
        if prefix + ".lora_A" in adapters:
            scaling = model.get_submodule(prefix).scaling
            w = w + scaling * (adapters[prefix + ".lora_B"] @ adapters[prefix + ".lora_A"]).to(w.device)
        return w.to(model.dtype)

    if fsdp.rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        files = shard_files([(n, model.dtype, s) for n, s in fsdp.base_shapes().items()], max_shard_bytes)
        names = ["model.safetensors"] if len(files) == 1 else [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                                               for i in range(1, len(files) + 1)]
        for name, specs in zip(names, files):
            save_safetensors(os.path.join(out_dir, name), specs, get)
        if len(files) > 1:  # after the shards: a reader that finds the index finds every file it names
            index = {"metadata": {"total_size": sum(math.prod(s) * d.itemsize for f in files for _, d, s in f)},
                     "weight_map": {n: name for name, specs in zip(names, files) for n, _, _ in specs}}
            atomic_write(os.path.join(out_dir, "model.safetensors.index.json"),
                         lambda f: json.dump(index, f, indent=2), "w")
        kept = {k: v for k, v in read_json(os.path.join(source, "config.json")).items()
                if k not in ("dtype", "quantization_config")} if source else {}
        config = {**kept, **config_to_hf(model.config, model.dtype), "tie_word_embeddings": False}  # head written
        atomic_write(os.path.join(out_dir, "config.json"), lambda f: json.dump(config, f, indent=2), "w")
        if source and os.path.isfile(generation := os.path.join(source, "generation_config.json")):
            with open(generation, "rb") as src:
                atomic_write(os.path.join(out_dir, "generation_config.json"), lambda f: shutil.copyfileobj(src, f))
    for _ in base:  # the other ranks join the same all-gathers; every rank frees the last unit
        pass
    if dist.is_initialized():
        dist.barrier()

# -----------------------------------------------------------------------------
# 10. Data, training loop, command line
# -----------------------------------------------------------------------------
# Needs: import argparse, contextlib, json, math, os, resource, sys, tempfile, time, numpy as np, torch,
# torch.distributed as dist; from above: GiB, fmt_bytes, memory_budget, format_budget, to_nf4, seeded, FSDP,
# OffloadedInputs, AdamW, CONFIGS, IGNORE_INDEX, NF4Linear, Llama, estimate_memory, format_estimate, UserError,
# require, print0, read_json, atomic_write, config_from_hf, load_checkpoint, initial_weights, save_checkpoint,
# resume, save_merged.

def load_tokens(path, vocab_size, seq_len, flag="--data"):
    """(tokens, loss_mask or None) from a --data (or --val_data) file (formats: see --help), checked: at least
    seq_len + 1 tokens, every id < vocab_size. .npy, .bin and .txt are memory-mapped."""
    where = f"{flag} {path}"
    require(os.path.isfile(path), f"{where}: no such file")
    ext = ".txt" if os.path.samefile(path, __file__) else os.path.splitext(path)[1].lower()  # default: our bytes
    require(ext in (".npy", ".npz", ".bin", ".txt"), f"{where}: unknown format {ext or '(no extension)'}; use .npy, "
                                                     ".npz, .bin, .txt" + " or dummy" * (flag == "--data"))
    require(ext != ".bin" or vocab_size <= 65536, f"{where}: a .bin holds uint16 ids, too few for this model's "
                                                  f"{vocab_size:,}-token vocabulary; save the tokens as .npy (uint32)")
    mask = None
    try:
        if ext == ".npz":
            with np.load(path, allow_pickle=False) as z:
                tokens, mask = z["tokens"], z["loss_mask"]
        elif ext == ".npy":
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            tokens = np.memmap(path, dtype=np.uint16 if ext == ".bin" else np.uint8, mode="r")
    except Exception as e:  # noqa: BLE001 -- not an array file, truncated, pickled, odd size, an array missing
        why = " ".join(str(e).split()).split(". ")[0]  # numpy's messages run to several sentences
        raise UserError(f"{where}: cannot be read as {ext} ({type(e).__name__}: {why})")
    require(tokens.ndim == 1 and np.issubdtype(tokens.dtype, np.integer),
            f"{where}: tokens must be a 1-D integer array, not {tokens.ndim}-D {tokens.dtype}")
    require(len(tokens) > seq_len, f"{where}: {len(tokens)} tokens, fewer than --seq_len + 1 = {seq_len + 1}")
    require((hi := int(tokens.max())) < vocab_size, f"{where}: token id {hi} >= vocab_size {vocab_size} of this model")
    lo = int(tokens.min()) if np.issubdtype(tokens.dtype, np.signedinteger) else 0  # one pass fewer if unsigned
    require(lo >= 0, f"{where}: negative token id {lo}")
    if mask is not None:
        require(mask.shape == tokens.shape, f"{where}: loss_mask has shape {mask.shape}, tokens {tokens.shape}")
        require(np.isin(mask, (0, 1)).all(), f"{where}: loss_mask holds values other than 0 and 1")
        require(mask[1:].any(), f"{where}: loss_mask counts no target (0 at every position after the first)")
        mask = mask.astype(bool)  # token 0 is never a target: mask[0] is not used
    return tokens, mask

def sequences(data, starts, T):
    """(inputs, targets), each (len(starts), T) int64: the T + 1 tokens of load_tokens' `data` from each start; a
    target at position i counts where loss_mask[i] is 1 (else IGNORE_INDEX)."""
    (ids, mask), starts = data, list(starts)
    tokens = torch.from_numpy(np.stack([ids[s:s + T + 1].astype(np.int64) for s in starts]))
    counted = torch.from_numpy(np.stack([mask[s + 1:s + T + 1] for s in starts])) if mask is not None else True
    return tokens[:, :-1], tokens[:, 1:].masked_fill(~torch.as_tensor(counted), IGNORE_INDEX)

def get_batch(data, step, micro, args, world, rank, vocab_size):
    """This rank's rows (inputs, targets), each (batch_size, seq_len), of micro-batch `micro` of the step's batch:
    rows of (seed, step) and batch_size x grad_accum x world alone, (micro, rank, row); data None: random tokens."""
    g = seeded(args.seed, "batch", step)
    n, T, first = args.batch_size * args.grad_accum * world, args.seq_len, (micro * world + rank) * args.batch_size
    rows = slice(first, first + args.batch_size)
    if data is None:
        tokens = torch.randint(vocab_size, (n, T + 1), generator=g)[rows]
        return tokens[:, :-1], tokens[:, 1:]
    return sequences(data, torch.randint(len(data[0]) - T, (n,), generator=g)[rows].tolist(), T)

def encode_prompt(text, vocab_size):
    """--prompt as token ids: its UTF-8 bytes for a byte-level model (default a newline), else comma-separated ids."""
    try:
        ids = (list(("\n" if text is None else text).encode("utf-8")) if vocab_size == 256 else
               [int(t) for t in (text or "").split(",") if t.strip()])
    except ValueError:
        ids = []
    want = ("non-empty text (its UTF-8 bytes are the tokens)" if vocab_size == 256 else
            f"comma-separated token ids below {vocab_size}, e.g. 128000,791")
    require(ids and all(0 <= i < vocab_size for i in ids), f"--prompt {text!r}: this model's prompt is {want}")
    return ids

@torch.no_grad()
def generate(model, prompt, n, window, device, temperature=0.0, seed=0):
    """n tokens continuing `prompt`: greedy (temperature 0) or drawn from softmax(logits / T) by a seeded CPU
    generator (the same on any device). No KV cache: forward re-runs on the last `window` tokens, on every rank."""
    g = seeded(seed, "sample")
    ids = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
    model.eval()  # no LoRA dropout
    # Compiled blocks would compile again for every new length: eager (the NF4 kernels still compiled)
    with torch.compiler.set_stance("eager_on_recompile"):
        for _ in range(n):
            logits = model(ids[:, -window:])[0, -1].float()  # (V,): the last position's
            probs = torch.softmax((logits - logits.max()).double() / max(temperature, 1e-300), -1)  # no overflow
            nxt = torch.multinomial(probs.cpu(), 1, generator=g).to(device) if temperature > 0 else logits.argmax()
            if dist.is_initialized():
                dist.broadcast(nxt := nxt.view(1), src=0)
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    model.train()
    return ids[0, len(prompt):].tolist()

def check_writable(args, rank):
    """Create --out, --merge_to (rank 0's) and --profile (every rank's), write a file in each: a bad path stops every
    rank now. Nothing is overwritten: --out with a checkpoint needs --resume, a --merge_to with a model is refused."""
    problem = None
    if rank == 0 and args.out and not args.resume and os.path.isfile(os.path.join(args.out, "latest")):
        problem = f"--out {args.out}: holds a run's checkpoint; --resume continues it, or choose another --out"
    if rank == 0 and args.merge_to and any(os.path.exists(os.path.join(args.merge_to, n)) for n in
                                           ("config.json", "model.safetensors", "model.safetensors.index.json")):
        problem = f"--merge_to {args.merge_to}: holds a model already; choose a new directory"
    for flag, path in (("--out", args.out), ("--merge_to", args.merge_to), ("--profile", args.profile)):
        if path and (rank == 0 or flag == "--profile") and problem is None:
            try:
                os.makedirs(path, exist_ok=True)
                tempfile.TemporaryFile(dir=path).close()
            except OSError as e:
                why = "a file, not a directory" if os.path.isfile(path) else e.strerror or e
                problem = f"{flag} {path}: cannot be written ({why})"
    if dist.is_initialized():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    require(problem is None, problem)

def peak_memory_gib(device, reserved=False):
    """Max over ranks, since reset_peak_memory: GPU memory allocated (or reserved) on CUDA, the resident set on
    the CPU (Linux's VmHWM; elsewhere the process's whole peak)."""
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_reserved if reserved else torch.cuda.max_memory_allocated)(device)
    else:  # getrusage's ru_maxrss (Linux: KiB) cannot be reset
        peak = proc_bytes("/proc/self/status", "VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t = torch.tensor(peak / GiB, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()

def open_metrics(out, start):
    """--out's metrics.jsonl, open to append, its records after step `start` dropped (a fresh run: every one; a
    line a crash cut short too: it does not end in "}")."""
    path, kept = os.path.join(out, "metrics.jsonl"), []
    if start and os.path.isfile(path):
        with open(path) as f:
            kept = [line.rstrip() + "\n" for line in f
                    if line.rstrip().endswith("}") and json.loads(line)["step"] <= start]
    atomic_write(path, lambda f: f.writelines(kept), "w")
    return open(path, "a")

def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: VmHWM starts again from the resident set now

@torch.no_grad()
def evaluate(model, val, args, world, rank, device):
    """(mean loss over the counted targets, sequences) of --val_data's first --eval_seqs sequences, i being tokens
    [i T, i T + T + 1): micro-batches of --batch_size a rank, every rank runs each (empty rows count nothing)."""
    T, B = args.seq_len, args.batch_size
    n = min(args.eval_seqs, (len(val[0]) - 1) // T)
    total = torch.zeros(2, dtype=torch.float64, device=device)  # the loss's sum and the count of its targets
    model.eval()
    for g in range(-(-n // (world * B))):  # global micro-batches: this rank's B rows of each
        rows = range((g * world + rank) * B, min((g * world + rank + 1) * B, n))
        x, y = torch.zeros(B, T, dtype=torch.long), torch.full((B, T), IGNORE_INDEX)
        if rows:
            x[:len(rows)], y[:len(rows)] = sequences(val, (i * T for i in rows), T)
        total += torch.stack([model(x.to(device), y.to(device), reduction="sum").double(),
                              (y != IGNORE_INDEX).sum().to(device, torch.float64)])
    model.train()
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).item(), n

def sparkline(values, width=40):
    """values as one line of bars, low to high, averaged down to `width` (a terminal that cannot show them: ASCII)."""
    bars = "▁▂▃▄▅▆▇█" if "utf" in (getattr(sys.stdout, "encoding", "") or "").lower() else "_.-~=*#@"
    v = [float(c.mean()) for c in np.array_split(np.asarray(values, dtype=float), min(width, len(values)))]
    lo, span = min(v), max(v) - min(v) or 1.0
    return "".join(bars[min(7, int((x - lo) / span * 8))] for x in v)

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # model
    p.add_argument("--model", default="tiny", help=f"one of {', '.join(CONFIGS)}")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="compute dtype")
    for flag, default in (("lora_rank", 8), ("lora_alpha", 16.0), ("lora_dropout", 0.0)):
        p.add_argument(f"--{flag}", type=type(default), default=default)
    p.add_argument("--checkpoint", metavar="DIR", help="a Hugging Face Llama directory; overrides --model")
    # data
    p.add_argument("--data", metavar="PATH", help=".npy, .npz (+ loss_mask), .bin, .txt or dummy; default: this file")
    p.add_argument("--batch_size", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--val_data", metavar="PATH", help="held-out tokens (any --data format): their loss, val_loss")
    p.add_argument("--eval_every", type=int, default=0, help="evaluate --val_data every N steps (0: at the end)")
    p.add_argument("--eval_seqs", type=int, default=64, help="the first K sequences of --val_data are evaluated")
    # optimization
    for flag, default in (("steps", 200), ("grad_accum", 1), ("lr", 3e-3), ("warmup_steps", 10), ("weight_decay", 0.0),
                          ("adam_eps", 1e-8), ("seed", 1337)):
        p.add_argument(f"--{flag}", type=type(default), default=default)
    p.add_argument("--grad_clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    # checkpoints
    p.add_argument("--out", metavar="DIR", help="write PEFT adapters and resumable state here")
    p.add_argument("--save_every", type=int, default=0, help="save to --out every N steps (0: at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--stop_at", type=int, default=0, help="stop after step N, as if interrupted")
    p.add_argument("--merge_to", metavar="DIR", help="at the end, write the merged model as a Hugging Face checkpoint")
    p.add_argument("--max_shard_size", type=float, default=5.0, metavar="GB", help="--merge_to: files up to GB each")
    # memory and speed
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="NF4 kernels and blocks")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True, help="per block")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
    p.add_argument("--cpu_offload", action="store_true", help="shards, gradients and AdamW on the host")
    p.add_argument("--offload_activations", action="store_true", help="checkpointed block inputs on the host")
    p.add_argument("--estimate", action="store_true", help="print the memory per rank (of WORLD_SIZE) and exit")
    def gib(v):  # --fit's number, or "auto" (no number)
        return v if v == "auto" else float(v)
    p.add_argument("--fit", nargs="?", const="auto", type=gib, metavar="GIB", help="choose the micro-batch, "
                   "checkpointing and offloads that fit GIB per GPU, keeping the batch (no GIB, on CUDA: the free "
                   f"memory less {FIT_MARGIN * 100:.0f}%% of the GPU's); the flags for them are then ignored")
    p.add_argument("--profile", metavar="DIR", help="trace steps 3-5 (on CUDA with a memory snapshot) to DIR")
    p.add_argument("--log_every", type=int, default=1)
    # sampling
    p.add_argument("--sample", type=int, default=0, metavar="N", help="after training, continue --prompt by N tokens")
    p.add_argument("--prompt", help="text for byte-level models (default a newline), else token ids: 1,791")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled (seeded by --seed)")
    args = p.parse_args(argv)
    for flag, least in [("batch_size", 1), ("seq_len", 1), ("steps", 1), ("grad_accum", 1), ("lora_rank", 1),
                        ("log_every", 1), ("warmup_steps", 0), ("save_every", 0), ("stop_at", 0), ("sample", 0),
                        ("temperature", 0), ("eval_every", 0), ("eval_seqs", 1)]:
        if getattr(args, flag) < least:
            p.error(f"--{flag} must be >= {least}, got {getattr(args, flag)}")
    for flag in ("lr", "weight_decay", "adam_eps", "grad_clip", "lora_alpha", "lora_dropout", "temperature"):
        if not math.isfinite(getattr(args, flag)):
            p.error(f"--{flag} must be a finite number, got {getattr(args, flag)}")
    for flag in ("max_shard_size",) + (("fit",) if args.fit not in (None, "auto") else ()):
        if not 0 < getattr(args, flag) < math.inf:
            p.error(f"--{flag} must be a positive number (GB), got {getattr(args, flag)}")
    if not 0 <= args.lora_dropout < 1:
        p.error(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}")
    if args.model not in CONFIGS and not args.checkpoint:
        p.error(f"--model {args.model}: unknown, choose from {', '.join(CONFIGS)}")
    if (args.save_every or args.resume) and not args.out:
        p.error("--save_every and --resume need --out DIR")
    if args.offload_activations and not args.checkpointing:
        p.error("--offload_activations offloads the checkpointed block inputs: it needs --checkpointing")
    if args.checkpoint:
        args.checkpoint = os.path.abspath(args.checkpoint)  # as saved in, and compared by, --resume
    return args

def model_config(args):
    """(name, LlamaConfig): --checkpoint's (named after its directory), else --model's."""
    if not args.checkpoint:
        return args.model, CONFIGS[args.model]
    require(os.path.isdir(args.checkpoint), f"--checkpoint {args.checkpoint}: no such directory")
    path = os.path.join(args.checkpoint, "config.json")
    return os.path.basename(os.path.normpath(args.checkpoint)), config_from_hf(read_json(path), path)

def predicted_memory(args, world, config=None):
    """estimate_memory (section 8) for this run's flags."""
    return estimate_memory(config or model_config(args)[1], world, args.batch_size, args.seq_len,
                           dtype_bytes=2 if args.dtype == "bf16" else 4, lora_rank=args.lora_rank,
                           checkpointing=args.checkpointing, offload=args.cpu_offload,
                           offload_activations=args.offload_activations, compiled=args.compile)

FIT_MARGIN = 0.1  # --fit with no number, on CUDA: the free memory less this share of the GPU's total
FIT_FLAGS = ("batch_size", "grad_accum", "checkpointing", "offload_activations", "cpu_offload")  # what --fit sets
# What --fit tries, fastest first on a GPU (the README says what each costs): (checkpointing,
# --offload_activations, --cpu_offload), each with every micro-batch that divides this rank's batch, largest first.
FIT_TIERS = [(False, False, False), (True, False, False), (True, True, False), (False, False, True),
             (True, False, True), (True, True, True)]

def fit_plans(args, n=None):  # --grad_accum makes up a smaller micro-batch: the same batch, the same rows
    n = n or args.batch_size * args.grad_accum
    return [argparse.Namespace(**{**vars(args), **dict(zip(FIT_FLAGS, (m, n // m, *tier)))})
            for tier in FIT_TIERS for m in range(n, 0, -1) if n % m == 0]

def plan_name(a):
    return (f"micro-batch {a.batch_size} x {a.grad_accum}" + ", checkpointing" * a.checkpointing
            + ", --offload_activations" * a.offload_activations + ", --cpu_offload" * a.cpu_offload)

def fit_budget(args, device):
    """(bytes per GPU --fit fits in, bytes of host memory available: inf where unknown), the least over ranks."""
    require(args.fit != "auto" or device.type == "cuda", "--fit: on a CPU give the memory to fit in, e.g. --fit 20")
    free, total = torch.cuda.mem_get_info(device) if args.fit == "auto" else (args.fit * GiB, 0)
    budget, host = free - FIT_MARGIN * total, host_available() or math.inf
    if dist.is_initialized():
        t = torch.tensor([budget, host], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        budget, host = t.tolist()
    return budget, host

def plan_fits(plan, world, config, budget, host):
    """(estimate, its GPU peak fits budget, its host memory, for this machine's ranks, fits host) of a plan."""
    est = predicted_memory(plan, world, config)
    return est, est["gpu_peak"] <= budget, est["host_state"] * int(os.environ.get("LOCAL_WORLD_SIZE", 1)) <= host

def fit(args, world, config, budget, host):
    """The first of fit_plans(args) that fits, every plan tried printed; none: one error naming the smallest peak."""
    print0(f"--fit: {budget / GiB:.2f} GiB per GPU" + (f", {host / GiB:.1f} GiB of host memory" * (host < math.inf)))
    for plan in fit_plans(args):
        est, gpu_ok, host_ok = plan_fits(plan, world, config, budget, host)
        verdict = "fits" if gpu_ok and host_ok else "too big" if not gpu_ok else "its host memory is not available"
        print0(f"  {plan_name(plan):<62} {est['gpu_peak'] / GiB:8.2f} GiB  {verdict}")
        if gpu_ok and host_ok:
            print0(f"--fit chose {plan_name(plan)}: {est['gpu_peak'] / GiB:.2f} GiB predicted per GPU")
            return plan
    raise UserError(f"--fit: no setting fits in {budget / GiB:.2f} GiB per GPU; the smallest predicted peak is "
                    f"{est['gpu_peak'] / GiB:.2f} GiB ({plan_name(plan)})" + ("" if host_ok else
                    f" and its {est['host_state'] / GiB:.1f} GiB of host memory are not available"))

def longest_context(args, world, config, budget, host):
    """(tokens, plan): the longest --seq_len that fits at micro-batch 1, and the FIT_TIERS setting that allows it."""
    best = (0, None)
    for plan in fit_plans(args, n=1):
        lo, hi = 0, 1 << 24
        while lo < hi:  # bisection: the estimate grows with the sequence length
            mid = (lo + hi + 1) // 2
            fits = plan_fits(argparse.Namespace(**{**vars(plan), "seq_len": mid}), world, config, budget, host)
            lo, hi = (mid, hi) if all(fits[1:]) else (lo, mid - 1)
        best = max(best, (lo, plan), key=lambda b: b[0])
    return best

PROGRESS_S = 10.0  # seconds between progress lines

def progress(items, what, total, nbytes):
    """(name, tensor) items as they come; on rank 0 a line at least every PROGRESS_S seconds (tensors done,
    bytes read, bytes/s, time left) and one at the end."""
    start = last = time.perf_counter()
    n = done = 0
    for n, (name, t) in enumerate(items, 1):  # t.nbytes: the bytes read (a checkpoint's dtype) or drawn
        done += t.nbytes
        yield name, t
        if (now := time.perf_counter()) - last >= PROGRESS_S:
            last, rate = now, done / (now - start)
            print0(f"{what}: {n:,}/{total:,} tensors, {fmt_bytes(done)} of {fmt_bytes(nbytes)}, {fmt_bytes(rate)}/s, "
                   f"{max(0, nbytes - done) / rate:.0f} s left")
    dt = max(time.perf_counter() - start, 1e-9)
    print0(f"{what}: {n:,} tensors, {fmt_bytes(done)} in {dt:.1f} s ({fmt_bytes(done / dt)}/s)")

def proc_bytes(path, key):  # the "key: N kB" line of a Linux /proc file, in bytes; None where there is none
    try:
        with open(path) as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration, ValueError):
        return None

def host_available():  # bytes of memory this machine can still give; None where unknown
    return proc_bytes("/proc/meminfo", "MemAvailable")

def check_fits(args, config, world, device):
    """Refuse, before anything is allocated, a model whose sharded state (the estimate's rows) would not fit the
    GPU, or this machine's available memory (offloaded or on the CPU; its ranks share it)."""
    est, local = predicted_memory(args, world, config), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else math.inf
    host = (est["host_state"] + (device.type == "cpu") * est["gpu_state"]) * local
    for need, have, where in ((est["gpu_state"], free, "per GPU"), (host, host_available() or math.inf,
                                                                   f"of this machine's memory for {local} rank(s)")):
        require(need <= have, f"the model's shards need {need / GiB:.2f} GiB {where} (--estimate), {have / GiB:.2f} "
                              f"GiB is available: more ranks, --cpu_offload, or --fit to choose the settings")

def build(args, config, device, checkpoint=None):
    """Model (meta) -> units -> real, zeroed shards, then each base weight made (read from load_checkpoint's
    `checkpoint` or drawn), quantized and cut to this rank's piece one at a time: no two unsharded weights alive."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    with torch.device("meta"):
        model = Llama(config, dtype, args.lora_rank, args.lora_alpha, args.lora_dropout, compile=args.compile)
    model.checkpointing = args.checkpointing
    if args.compile:  # each block's forward, its checkpoint included; the sharding hooks stay eager
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward)
    fsdp = FSDP(model, model.units(), device, dtype, offload=args.cpu_offload)
    # its own stream: a wait for a collective (on FSDP's side stream) must not wait for these copies too
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    model.offload_activations = OffloadedInputs(side) if args.offload_activations else None

    shapes = fsdp.base_shapes()
    base, nbytes = checkpoint or (initial_weights(shapes, args.seed, device), 4 * sum(map(math.prod, shapes.values())))
    what = f"loading {args.checkpoint}" if checkpoint else "drawing a random base"
    for name, t in progress(base, what, len(shapes), nbytes):
        t = t.to(device, dtype)  # then NF4 for an NF4Linear's weight
        require(t.isfinite().all(), f"--checkpoint {args.checkpoint}: tensor {name} holds inf or NaN")
        nf4 = isinstance(model.get_submodule(name.rsplit(".", 1)[0]), NF4Linear) and name.endswith(".weight")
        fsdp.load_full(name, to_nf4(t, compile=args.compile) if nf4 else t)
    for name, t in initial_weights(fsdp.adapter_shapes(), args.seed):
        fsdp.load_full(name, t)
    return model, fsdp

def learning_rate(step, args):
    """Linear warmup over --warmup_steps, then cosine decay to 10% of --lr at --steps."""
    if step < (w := args.warmup_steps):
        return args.lr * ((step + 1) / w)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - w) / max(1, args.steps - w)))))

def train_step(model, fsdp, optimizer, batches, grad_clip, device):
    """One AdamW step over this rank's micro-batches [(inputs, targets)] -> (loss, optimizer seconds). The loss is
    the mean over the global batch's counted targets (any split gives the same); a non-finite one skips the update."""
    count = sum((y != IGNORE_INDEX).sum() for _, y in batches).to(device)
    if dist.is_initialized():
        dist.all_reduce(count)
    count = max(1, count.item())  # a batch that counts nothing: loss 0 and zero gradients
    loss_sum = torch.zeros((), device=device)
    for x, y in batches:
        with torch.profiler.record_function("forward"):
            loss = model(x.to(device), y.to(device), reduction="sum")
        with torch.profiler.record_function("backward"):
            # x world: the reduce-scatter averages, so the masters get d(global sum); 1 / count after, in fp32
            (loss * fsdp.world).backward()  # each unit's gradients are reduce-scattered as its backward ends
        loss_sum += loss.detach()
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
    loss = (loss_sum / count).item()  # also waits for the device
    t0 = time.perf_counter()
    if math.isfinite(loss):
        with torch.profiler.record_function("optimizer"):
            for p in fsdp.parameters():  # d(global sum) -> d(global mean), in fp32
                if p.grad is not None:
                    p.grad.div_(count)
            if grad_clip > 0:
                fsdp.clip_grad_norm_(grad_clip)
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    optimizer.zero_grad(set_to_none=True)  # also after a skipped step: the next one starts from none
    return loss, time.perf_counter() - t0

def train(args):
    """Train; returns (summary dict, per-step losses, the FSDP object)."""
    # the device (cuda:LOCAL_RANK on GPUs) and, under torchrun (RANK set), a process group: NCCL or gloo
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    require(torch.cuda.is_available() or not cuda, "--device cuda: no CUDA GPU is available")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:  # expandable segments (as torchtune and axolotl run) unless the user set the allocator up
        if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        torch.cuda.set_device(device)
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    name, config = model_config(args)
    if args.fit is not None:  # before anything reads the flags it sets
        args = fit(args, world, config, *fit_budget(args, device))
    check_writable(args, rank)
    data = None if args.data == "dummy" else load_tokens(args.data or __file__, config.vocab_size, args.seq_len)
    val = load_tokens(args.val_data, config.vocab_size, args.seq_len, "--val_data") if args.val_data else None
    prompt = encode_prompt(args.prompt, config.vocab_size) if args.sample else None
    checkpoint = load_checkpoint(args.checkpoint, config) if args.checkpoint else None  # every header checked
    check_fits(args, config, world, device)
    print0(format_budget(name, memory_budget(config, args.lora_rank)))
    model, fsdp = build(args, config, device, checkpoint)
    # The peaks of training, not of loading (--estimate has both): what loading left cached goes back first
    if cuda:
        torch.cuda.empty_cache()
    reset_peak_memory(device)
    peaks = lambda: (peak_memory_gib(device), peak_memory_gib(device, reserved=True) if cuda else None)  # noqa: E731
    optimizer = AdamW(fsdp.parameters(), lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay)
    start = resume(args, fsdp, optimizer) if args.resume else 0
    last_step = min(args.steps, args.stop_at or args.steps)
    require(start < last_step, f"nothing to do: --resume is at step {start}, the run ends at step {last_step} "
                               f"(--steps {args.steps}, --stop_at {args.stop_at})")
    require(not args.profile or last_step - start >= 3, f"--profile traces steps 3-5: this run has {last_step - start}")
    print0(f"model {name}: {fsdp.local_bytes() / 2**20:.1f} MiB of weights on this rank, world {world}, {device}, "
           f"{args.dtype}, compile {args.compile}, checkpointing {args.checkpointing}, offload {args.cpu_offload}"
           + "\ncompiling the first step (about a minute on a CPU); --no-compile skips it" * args.compile)

    losses, val_losses, timings = [], [], []  # timings: per step (seconds, comm wait, optimizer seconds)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * world
    profiler, predicted = None, predicted_memory(args, world, config)["gpu_peak"] / GiB
    metrics = open_metrics(args.out, start) if args.out and rank == 0 else None

    def record(**r):  # a line of --out's metrics.jsonl, on disk at once (a crashed run keeps what it logged)
        if metrics:
            print(json.dumps(r), file=metrics, flush=True)

    def export_profile(prof):  # after step 5, or at the end of a shorter run
        prof.export_chrome_trace(trace := os.path.join(args.profile, f"trace_rank{rank}.json"))
        print0(f"profile: {trace} (open in https://ui.perfetto.dev or chrome://tracing)")
        if cuda:  # the allocator's history recorded so far, then no more recording
            torch.cuda.memory._dump_snapshot(path := os.path.join(args.profile, f"memory_rank{rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            print0(f"memory snapshot: {path} (drag into https://pytorch.org/memory_viz)")

    if args.profile:  # a trace of steps 3-5 (after compilation and warm-up)
        activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * cuda
        profiler = torch.profiler.profile(activities=activities, profile_memory=True, on_trace_ready=export_profile,
                                          schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1))
        profiler.start()
    for step in range(start, last_step):
        t0 = time.perf_counter()
        optimizer.param_groups[0]["lr"] = lr = learning_rate(step, args)
        torch.manual_seed(seeded(args.seed, "dropout", rank, step).initial_seed())  # LoRA dropout: (seed, rank, step)
        batches = [get_batch(data, step, m, args, world, rank, config.vocab_size) for m in range(args.grad_accum)]
        try:
            loss, optim_s = train_step(model, fsdp, optimizer, batches, args.grad_clip, device)
        except torch.OutOfMemoryError:  # on one rank: it exits, and torchrun ends the others
            total = torch.cuda.mem_get_info(device)[1] if cuda else os.sysconf("SC_PHYS_PAGES") * resource.getpagesize()
            raise UserError(f"out of memory on {device} at step {step + 1}: --estimate predicted a peak of "
                            f"{predicted:.2f} GiB per GPU, the device has {total / GiB:.2f} GiB; --fit chooses "
                            "settings that fit") from None
        require(math.isfinite(loss), f"loss is {loss} at step {step + 1}; stopped before updating"  # no save since
                + (f"; the last checkpoint in {args.out} is intact" if args.out else ""))
        dt = time.perf_counter() - t0
        losses.append(loss)
        timings.append((dt, fsdp.take_comm_wait_s(), optim_s))  # the step is done: so are its events
        if profiler is not None:
            profiler.step()
            if profiler.step_num == 2 and cuda:  # on CUDA the allocator's history over 3-5 (Python stacks: cheap)
                torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
        if step % args.log_every == 0 or step + 1 == last_step:
            mem = peak_memory_gib(device)
            print0(f"step {step + 1}/{args.steps} | loss {loss:.4f} | lr {lr:.1e} | {dt * 1000:.0f} ms | "
                   f"{tokens_per_step / dt:,.0f} tok/s | mem {mem:.2f} GiB")
            record(step=step + 1, loss=loss, lr=lr, ms=round(dt * 1000, 2), tokens_per_s=round(tokens_per_step / dt, 1),
                   mem_gib=round(mem, 4))
        if step == start:  # step 1 (compiling, autotuning, first allocations): its peaks apart from the steady state's
            first_peaks = peaks()
            reset_peak_memory(device)
        if val and (step + 1 == last_step or args.eval_every and (step + 1) % args.eval_every == 0):
            val_loss, n = evaluate(model, val, args, world, rank, device)
            val_losses.append(val_loss)
            print0(f"eval step {step + 1} | val_loss {val_loss:.4f} | {n} sequences of --val_data")
            record(step=step + 1, val_loss=val_loss)
        if args.out and (step + 1 == last_step or args.save_every and (step + 1) % args.save_every == 0):
            save_checkpoint(args.out, step + 1, fsdp, optimizer, args)
    if profiler is not None:
        profiler.stop()  # exports steps 3 to the last, if the run ended before step 5
    # The steady state's peaks (one step: step 1's), before the merge and the sample allocate their own.
    steady = peaks() if last_step - start > 1 else first_peaks
    if args.merge_to:
        save_merged(args.merge_to, fsdp, model, args.checkpoint, args.max_shard_size * 1e9)
        print0(f"merged model written to {args.merge_to}")
    if args.sample:  # after the saves: what was trained is on disk whatever happens here
        ids = generate(model, prompt, args.sample, min(args.seq_len, config.max_position_embeddings), device,
                       args.temperature, args.seed)
        fsdp.reshard()  # the last forward left its last unit gathered
        text = config.vocab_size == 256  # a byte-level model: show text (invalid UTF-8 as U+FFFD)
        sample = bytes(ids).decode("utf-8", errors="replace") if text else ids
        print0(f"sample ({args.sample} tokens, temperature {args.temperature}):\n"
               + (bytes(prompt).decode("utf-8", errors="replace") + sample if text else str(sample)))
    print0(f"loss {sparkline(losses)} {losses[0]:.3f} -> {losses[-1]:.3f}" + (
        f" | val_loss {sparkline(val_losses)} {val_losses[0]:.3f} -> {val_losses[-1]:.3f}" if val_losses else ""))
    # Median step time (the first compiles) split: waits for late all-gathers/reduce-scatters, optimizer, compute.
    step_s, wait_s, optim_s = (np.median(np.array(timings[1:] or timings), axis=0) * 1000).tolist()
    summary = dict(model=name, world_size=world, steps=last_step, final_loss=losses[-1], first_loss=losses[0],
                   step_ms=round(step_s, 2), tokens_per_s=round(tokens_per_step / (step_s / 1000), 1),
                   peak_mem_gib=round(steady[0], 4), step1_peak_mem_gib=round(first_peaks[0], 4),
                   predicted_peak_gib=round(predicted, 4), seq_len=args.seq_len,
                   **{k: getattr(args, k) for k in FIT_FLAGS}, dtype=args.dtype, device=device.type,
                   compute_ms=round(step_s - wait_s - optim_s, 2), comm_wait_ms=round(wait_s, 2),
                   optimizer_ms=round(optim_s, 2))
    if cuda:
        summary.update(peak_reserved_gib=round(steady[1], 4), step1_peak_reserved_gib=round(first_peaks[1], 4))
    summary.update({"val_loss": val_losses[-1]} if val_losses else {}, **{"sample": sample} if args.sample else {})
    return summary, losses, fsdp

def main(argv=None):
    args = parse_args(argv)
    try:
        if args.estimate:  # the memory tables from the config alone: nothing is allocated
            world, (name, config), longest = int(os.environ.get("WORLD_SIZE", 1)), model_config(args), {}
            if args.fit is not None:  # the plan --fit would run, and the longest context at micro-batch 1
                cuda = torch.cuda.is_available() and args.device != "cpu"
                args = fit(args, world, config, *(budget := fit_budget(args, torch.device("cuda" if cuda else "cpu"))))
                longest = dict(zip(("max_seq_len", "plan"), longest_context(args, world, config, *budget)))
                print0(f"longest context that fits at micro-batch 1: {longest['max_seq_len']:,} tokens "
                       f"({plan_name(longest.pop('plan'))}); the model allows {config.max_position_embeddings:,}")
            est = predicted_memory(args, world, config)
            print0(format_budget(name, memory_budget(config, args.lora_rank)))
            print0(format_estimate(name, est, world, args.cpu_offload))
            flags = ("seq_len", "dtype", "lora_rank", *FIT_FLAGS, "compile")
            summary = dict(model=name, world_size=world, **{k: getattr(args, k) for k in flags},
                           predicted_peak_gib=round(est["gpu_peak"] / GiB, 3),
                           predicted_host_gib=round(est["host_state"] / GiB, 3), **longest)
        else:
            summary = train(args)[0]
    except (UserError, torch.OutOfMemoryError) as e:  # bad input, or memory (outside a step too): one line, exit 2
        why = e if isinstance(e, UserError) else f"out of memory ({str(e).splitlines()[0]}); --fit chooses settings"
        print(f"error: {why}", file=sys.stderr, flush=True)
        if dist.is_initialized() and dist.get_world_size() > 1:  # a peer may wait in a collective: tearing gloo's
            sys.stdout.flush()  # threads down under it aborts this process: leave at once; torchrun ends the peer
            os._exit(2)
        raise SystemExit(2)
    print0(json.dumps(summary))
    if dist.is_initialized():
        # gloo's threads free each collective's tensors after it completes: let them, before teardown (else: abort)
        dist.barrier()
        dist.destroy_process_group()
    return summary

if __name__ == "__main__":
    main()
