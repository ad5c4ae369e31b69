"""
qlora_fsdp.py: fine-tune Llama models that do not fit on a GPU, all of it in this one file.

QLoRA (a frozen 4-bit NormalFloat base with small trainable LoRA adapters), sharded across
processes the way PyTorch's FSDP2 does it, written out by hand on torch.distributed. It is the
talk "Slaying OOMs with PyTorch FSDP and torchao" (Mark Saroufim, Jane Xu) turned into code.

Part I is the lesson: one path, plain Llama with QLoRA on its seven projections, sharded and
trained, ending with the training loop. Each section needs only torch and the sections above it
(its first comment says what), so it can be lifted out alone.
   1. memory accounting      2. NF4 quantization      3. NF4 tensor subclass    4. LoRA
   5. sharding and offload   6. foreach AdamW         7. Llama                  8. training
Part II extends Part I's names for the product (subclasses, wrappers, registrations); Part I
never names it. Skip it on a first read.
   9. faster NF4             10. any model            11. the Llama family, packing
  12. long context          13. fitting in memory (tiles, the peak, --fit)
  14. Hugging Face files    15. your data            16. a run                 17. the CLI

Run it (more in the README and --help):
  torchrun --nproc_per_node 2 qlora_fsdp.py     # the tiny model on this file's bytes, CPU
  torchrun --nproc_per_node 2 qlora_fsdp.py --checkpoint DIR --data train.jsonl --out runs/a
  python qlora_fsdp.py --checkpoint DIR --adapter runs/a --steps 0 --chat     # talk to it
"""

import contextlib
import enum
import functools
import hashlib
import itertools
import math
import os
import random
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.fx.experimental._config as fx_config
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils.checkpoint import checkpoint

GiB = 1024**3

# =============================================================================
# Part I: the lesson
# =============================================================================

# -----------------------------------------------------------------------------
# 1. Memory accounting: where the bytes go before a single activation exists
# -----------------------------------------------------------------------------
# Needs: from typing import NamedTuple.
#
# Full fine-tuning in bf16 keeps, per parameter, the weight (2 B), its gradient (2 B) and
# Adam's two moments (2 x 2 B): 8 B per parameter. Llama-2-7B's 6.74 B parameters need
# 54 GB (the talk's 7 B x 8 B = 56 GB) before a single activation exists.
# QLoRA freezes the base in NF4 (section 2) and trains only LoRA adapters, in fp32 (4 B)
# with fp32 gradients (4 B) and two fp32 moments (8 B): 16 B per *adapter* parameter,
# and there are only about 0.3% of them.
# NF4 stores 64 weights in 32 B of codes, a 1 B int8 scale, and a 4 B fp32 factor shared
# by 256 scales: 4 + 8/64 + 32/(64*256) = 4.127 bits (0.516 B) per parameter.
NF4_BITS_PER_PARAM = 4 + 8 / 64 + 32 / (64 * 256)


def linear_shapes(config):
    """(out, in) of each of a Llama block's 7 projections, by their Hugging Face names."""
    d = config.hidden_size
    ffn = config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    return {
        "self_attn.q_proj": (q_dim, d),
        "self_attn.k_proj": (kv_dim, d),
        "self_attn.v_proj": (kv_dim, d),
        "self_attn.o_proj": (d, q_dim),
        "mlp.gate_proj": (ffn, d),
        "mlp.up_proj": (ffn, d),
        "mlp.down_proj": (d, ffn),
    }


class ParamCounts(NamedTuple):
    """A Llama config's parameters, by what QLoRA does with each kind."""

    linear: int  # the 7 projections of every block: frozen, NF4
    head: int  # lm_head: frozen, dense
    dense: int  # the embeddings and norms: frozen, in the compute dtype
    lora: int  # LoRA's A and B on every projection: trained, fp32


def count_params(config, lora_rank=8):
    """The parameters of a Llama config, counted from its shapes."""
    layers = config.num_hidden_layers
    d = config.hidden_size
    shapes = linear_shapes(config).values()
    linear = layers * sum(out * inp for out, inp in shapes)
    lora = layers * sum(lora_rank * (inp + out) for out, inp in shapes)
    embeddings = config.vocab_size * d
    norms = (2 * layers + 1) * d  # two per block, one final
    head = config.vocab_size * d
    return ParamCounts(linear, head, embeddings + norms, lora)


class StateBytes(NamedTuple):
    """Bytes that live from one step to the next."""

    params: float
    grads: float
    optimizer: float

    def total(self):
        return self.params + self.grads + self.optimizer


class MemoryBudget(NamedTuple):
    n_params: int
    n_lora: int
    full_bf16: StateBytes
    qlora: StateBytes


def memory_budget(counts):
    """count_params' counts -> the bytes of full bf16 fine-tuning and of QLoRA."""
    total = counts.linear + counts.head + counts.dense
    # Everything trains in bf16: weights, gradients, two moments.
    full = StateBytes(params=2 * total, grads=2 * total, optimizer=4 * total)
    # An NF4 base, the rest in bf16, and fp32 adapters, the only ones with gradients and moments.
    nf4 = counts.linear * NF4_BITS_PER_PARAM / 8
    qlora = StateBytes(
        params=nf4 + 2 * (total - counts.linear) + 4 * counts.lora,
        grads=4 * counts.lora,
        optimizer=8 * counts.lora,
    )
    return MemoryBudget(total, counts.lora, full, qlora)


# -----------------------------------------------------------------------------
# 2. NF4 quantization with double-quantized scales (QLoRA, Dettmers et al. 2023)
# -----------------------------------------------------------------------------
# Needs: import torch, torch.fx.experimental._config as fx_config, torch.nn.functional as F.
#
# NormalFloat-4 has 16 values placed at quantiles of N(0, 1), rescaled to [-1, 1], with an
# exact 0 (paper, Appendix E; bitsandbytes' get_4bit_type("nf4")). Code i is NF4[i].
# fmt: off
NF4_VALUES = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]
# fmt: on
NF4 = torch.tensor(NF4_VALUES, dtype=torch.float32)
# Rounding to the nearest value is bucketize on the 15 midpoints: no (numel x 16) distances.
NF4_MIDPOINTS = [(a + b) / 2 for a, b in zip(NF4_VALUES[:-1], NF4_VALUES[1:])]

# torch.compile turns the plain kernels below into fused loops (Triton on CUDA, C++ on the CPU).
# Sections 2-4 take compile=None (COMPILE), True or False: both give the same bits.
COMPILE = True
QUANT_CHUNK = 1 << 24  # elements quantized per call: a huge matrix never has an fp32 copy
DEQUANT_CHUNK = 1 << 22  # elements per pass of the eager dequantize


def use_compiled(compile, t):
    """Whether to run a compiled kernel on t: as `compile` says (None: COMPILE), but not on
    "meta" (no data) nor inside an outer torch.compile (which traces the plain function)."""
    wanted = COMPILE if compile is None else compile
    return wanted and t.device.type != "meta" and not torch.compiler.is_compiling()


def _quantize_blocks(w, block_size: int):
    """w (n_blocks * block_size,) -> codes (numel/2,) uint8, absmax (n_blocks,) fp32: each
    block scaled by its exact absmax, rounded to the nearest value (as bitsandbytes does)."""
    blocks = w.float().view(-1, block_size)  # (n_blocks, 64)
    absmax = blocks.abs().amax(dim=1)  # (n_blocks,)
    normalized = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    midpoints = torch.tensor(NF4_MIDPOINTS, device=w.device)
    codes = torch.bucketize(normalized, midpoints).to(torch.uint8).view(-1)
    # Two codes per byte, the first element in the high nibble: [a, b, c, d] -> [ab, cd].
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed, absmax


def _double_quantize(absmax, scaler_block_size: int):
    """The fp32 block scales to int8 by torchao's scheme: subtract the global mean, then per
    group of 256 scales (a partial last one zero padded) q = round(s * factor), factor = 127 /
    absmax(group) (torchao's 128 clips each group's largest scale by a step; 127 never does).
    Returns scale_q (n_blocks,) int8, scale_factor (n_groups,) fp32, scale_mean () fp32."""
    n = absmax.numel()
    mean = absmax.mean()
    padded = F.pad(absmax - mean, (0, -n % scaler_block_size))
    groups = padded.view(-1, scaler_block_size)  # (n_groups, 256)
    # The clamp keeps the factor finite for a group of equal scales (all 0 after the mean).
    factor = 127.0 / groups.abs().amax(dim=1).clamp_min(1e-30)
    q = (groups * factor[:, None]).round().clamp(-128, 127).to(torch.int8)
    return q.view(-1)[:n], factor, mean


def _dequantize_scales(scale_q, scale_factor, scale_mean, scaler_block_size: int):
    """The (n_blocks,) fp32 block scales from their int8 codes: q / factor[group] + mean."""
    group = torch.arange(scale_q.numel(), device=scale_q.device) // scaler_block_size
    return scale_q.float() / scale_factor[group] + scale_mean


_NF4_ON = {}  # device -> NF4 there, copied once: a host copy per eager dequantize would wait


def _dequantize_blocks(packed, absmax, block_size: int, dtype: torch.dtype, codebook=NF4):
    """packed (numel/2,) uint8, absmax (n_blocks,) -> w = NF4[code] * absmax, (numel,)."""
    codes = torch.stack([packed >> 4, packed & 0xF], dim=-1).view(-1).int()  # the nibbles
    values = codebook.to(packed.device).index_select(0, codes)
    return (values.view(-1, block_size) * absmax[:, None]).to(dtype).view(-1)


def _dequantize(inner, block_size: int, scaler_block_size: int, dtype: torch.dtype):
    """inner: quantize_nf4's four tensors -> the weight, flat, of dtype."""
    packed, scale_q, scale_factor, scale_mean = inner
    absmax = _dequantize_scales(scale_q, scale_factor, scale_mean, scaler_block_size)
    return _dequantize_blocks(packed, absmax, block_size, dtype)


def compile_dynamic(fn):
    """torch.compile(fn), one graph for every shape and caller (no size assumed equal to another
    or special for being 1, no view's base nor autograd state guarded on), made at the first
    call: importing the compiler costs a process that never uses it a second."""
    compiled = None

    def call(*args):
        nonlocal compiled
        compiled = compiled or torch.compile(fn, dynamic=True)
        args = [a.detach() if torch.is_tensor(a) else a for a in args]  # not views
        sizes = fx_config.patch(use_duck_shape=False, backed_size_oblivious=True)
        # Caches key a graph by its code, not these settings: the tag keeps out its other guards.
        tag = torch.compiler.config.patch(cache_key_tag="sizes: oblivious, not duck")
        with sizes, tag, torch._C._AutoDispatchBelowADInplaceOrView():
            return compiled(*args)

    return call


_quantize_blocks_compiled = compile_dynamic(_quantize_blocks)
_dequantize_compiled = compile_dynamic(_dequantize)
# Faster kernels by output dtype, called as _dequantize is (section 9 adds bf16's).
DEQUANTIZE_KERNELS = {}


def quantize_nf4(weight, block_size=64, scaler_block_size=256, compile=None):
    """weight (numel % block_size == 0) -> packed, scale_q, scale_factor, scale_mean."""
    n = weight.numel()
    if n % block_size or n == 0:
        raise ValueError(
            f"NF4 needs a positive number of elements divisible by block_size="
            f"{block_size}; got shape {tuple(weight.shape)} ({n} elements)"
        )
    if block_size % 2:
        raise ValueError(f"block_size must be even (two codes per byte), got {block_size}")
    kernel = _quantize_blocks_compiled if use_compiled(compile, weight) else _quantize_blocks
    flat = weight.detach().reshape(-1)
    # In chunks of whole blocks: a big matrix never has a whole fp32 copy.
    step = max(block_size, QUANT_CHUNK // block_size * block_size)
    with torch.no_grad():
        chunks = [kernel(flat[i : i + step], block_size) for i in range(0, n, step)]
    packed = torch.cat([codes for codes, _ in chunks])
    absmax = torch.cat([scales for _, scales in chunks])
    # An inf or NaN anywhere reaches every block through the scales' mean.
    if absmax.device.type != "meta" and not absmax.isfinite().all():
        raise ValueError(
            f"NF4 cannot quantize a weight holding inf or NaN (shape {tuple(weight.shape)})"
        )
    return (packed, *_double_quantize(absmax, scaler_block_size))


def dequantize_nf4(
    packed,
    scale_q,
    scale_factor,
    scale_mean,
    block_size=64,
    scaler_block_size=256,
    dtype=torch.bfloat16,
    compile=None,
):
    """quantize_nf4's four tensors -> the weight, flat, of `dtype`: compiled, one fused
    kernel; eager, at most half the weight at a time, so that no temporary outgrows it."""
    inner = [t.detach() for t in (packed, scale_q, scale_factor, scale_mean)]
    blocks = (block_size, scaler_block_size)
    with torch.no_grad():  # frozen weights are never part of the autograd graph
        outer = torch.compiler.is_compiling()  # traced whole into an outer graph
        if outer or use_compiled(compile, packed):
            kernel = _dequantize if outer else _dequantize_compiled
            return DEQUANTIZE_KERNELS.get(dtype, kernel)(inner, *blocks, dtype)
        absmax = _dequantize_scales(scale_q, scale_factor, scale_mean, scaler_block_size)
        if packed.device not in _NF4_ON:  # eager only: compiled, NF4 is a constant of the graph
            _NF4_ON[packed.device] = NF4.to(packed.device)
        out = torch.empty(packed.numel() * 2, dtype=dtype, device=packed.device)
        step = max(1, min(DEQUANT_CHUNK, packed.numel()) // block_size)  # blocks
        chunks = zip(packed.split(step * block_size // 2), absmax.split(step))
        for part, (codes, scales) in zip(out.split(step * block_size), chunks):
            part.copy_(_dequantize_blocks(codes, scales, block_size, dtype, _NF4_ON[packed.device]))
        return out


# -----------------------------------------------------------------------------
# 3. NF4Tensor: a tensor subclass so 4-bit weights behave like ordinary tensors
# -----------------------------------------------------------------------------
# Needs: import hashlib, torch, torch.nn as nn, torch.nn.functional as F; from typing import
# Optional; from above: quantize_nf4, dequantize_nf4.
#
# A "wrapper" subclass has no storage of its own. It reports the original shape and float
# dtype and holds four inner tensors, so F.linear, .to(), torch.save and torch.compile see
# a tensor. For an (out, in) weight of numel elements:
#   packed        (numel/2,)             uint8  codes, row-major, first of each pair high
#   scale_q       (numel/64,)            int8   double-quantized absmax of each block of 64
#   scale_factor  (ceil(numel/64/256),)  fp32   one per group of 256 scales (a partial too)
#   scale_mean    ()                     fp32   the mean subtracted from the scales
# Everything is flat, so that sharding (section 5) can cut each in its own dtype.

aten = torch.ops.aten
# The namespace of this module's custom ops: a copy of a section elsewhere gets its own.
OPS = __name__.replace(".", "_")


class NF4Tensor(torch.Tensor):
    """A 4-bit weight (the layout above) as a tensor of its shape and float dtype: F.linear,
    .to(), .cpu()/.cuda(), clone, torch.save and torch.compile work; other ops raise."""

    INNER = ("packed", "scale_q", "scale_factor", "scale_mean")

    @staticmethod
    def __new__(cls, inner, shape, dtype, *blocks):
        device = inner[0].device
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)

    def __init__(self, inner, shape, dtype, block_size=64, scaler_block_size=256):
        """inner: quantize_nf4's four tensors; shape and dtype: the weight's."""
        for name, t in zip(self.INNER, inner):
            setattr(self, name, t)
        self.block_size = block_size
        self.scaler_block_size = scaler_block_size

    def inner(self):
        return [getattr(self, name) for name in self.INNER]

    def _with_inner(self, fn, dtype=None):  # fn(each inner tensor), the rest alike
        inner = [fn(t) for t in self.inner()]
        blocks = (self.block_size, self.scaler_block_size)
        return NF4Tensor(inner, self.shape, dtype or self.dtype, *blocks)

    def dequantize(self, dtype=None, compile=None):
        blocks = (self.block_size, self.scaler_block_size)
        flat = dequantize_nf4(*self.inner(), *blocks, dtype or self.dtype, compile)
        return flat.view(self.shape)

    # torch.compile flattens the subclass into its inner tensors and rebuilds it from them.
    def __tensor_flatten__(self):
        meta = (tuple(self.shape), self.dtype, self.block_size, self.scaler_block_size)
        return list(self.INNER), meta

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return NF4Tensor([inner[name] for name in NF4Tensor.INNER], *meta)

    def _stable_hash_for_caching(self):
        """The key torch.compile's cache files this tensor under: its layout, not its data."""
        inner = [(tuple(t.shape), str(t.dtype), t.device.type) for t in self.inner()]
        key = (self.__tensor_flatten__()[1], self.requires_grad, inner)
        return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()

    def __repr__(self):
        blocks = f"block_size={self.block_size}"
        return f"NF4Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, {blocks})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:  # y = x W^T (+ b), with a gradient for x only
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            y = linear_nf4(args[0], args[1])
            return y if bias is None else y + bias
        if func is torch.Tensor.to:
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            return _nf4_to_copy(args[0], device, dtype, non_blocking)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in NF4_OPS:
            return NF4_OPS[func](*args, **(kwargs or {}))
        raise NotImplementedError(f"NF4Tensor does not support {func}; call .dequantize() first")


def _nf4_to_copy(t, device=None, dtype=None, non_blocking=False, **_):
    """.to(), .cpu(), .cuda(), .half(): a move keeps the data packed; a cast dequantizes
    (.to(dtype) asks for the dense weight), but a module's parameter is relabeled, its codes
    kept: nn.Module.to(dtype) casts every one, and a dense copy is what QLoRA avoids."""
    parameter = isinstance(t, nn.Parameter)
    if device is not None and device != t.device:
        t = t._with_inner(lambda x: x.to(device, non_blocking=non_blocking))
    if dtype is None or parameter and dtype == t.dtype:
        return t
    if parameter:
        return t._with_inner(lambda x: x, dtype)
    return t.dequantize(dtype)  # even to its own dtype: how one asks for the dense weight


# Every op an NF4Tensor supports (section 9 adds more); anything else raises, naming it.
NF4_OPS = {
    aten.detach.default: lambda t: t._with_inner(aten.detach.default),
    aten.alias.default: lambda t: t._with_inner(aten.alias.default),
    aten.clone.default: lambda t, **_: t._with_inner(torch.clone),  # the codes, exactly
    aten._to_copy.default: _nf4_to_copy,
}


def to_nf4(weight, block_size=64, scaler_block_size=256, compile=None):
    """Quantize a float tensor to an NF4Tensor that reports weight's shape and dtype."""
    inner = quantize_nf4(weight, block_size, scaler_block_size, compile)
    return NF4Tensor(inner, weight.shape, weight.dtype, block_size, scaler_block_size)


# y = x W^T with W frozen in NF4, as a custom op whose backward, grad_x = grad_y W, is the
# same op with W dequantized again. Saved for backward are the packed inner tensors, never
# a dense W. It is not an autograd.Function: torch.compile traces through one, and its CSE
# merges the forward's and the backward's dequantize into one call whose dense result is
# kept for backward, and QLoRA's saving is gone. A custom op is opaque to the compiler.
@torch.library.custom_op(f"{OPS}::matmul_nf4", mutates_args=())
def _matmul_nf4(
    x: torch.Tensor,
    inner: list[torch.Tensor],
    sizes: list[int],
    transpose: bool,
    compile: Optional[bool],
) -> torch.Tensor:
    """x W^T (..., in) -> (..., out) if transpose, else x W; sizes: out, the block sizes."""
    out_features, block_size, scaler_block_size = sizes
    w = dequantize_nf4(*inner, block_size, scaler_block_size, x.dtype, compile)
    w = w.view(out_features, -1)  # (out, in)
    return x @ (w.T if transpose else w)


@_matmul_nf4.register_fake
def _(x, inner, sizes, transpose, compile):
    out_features = sizes[0]
    in_features = 2 * inner[0].numel() // out_features
    return x.new_empty(*x.shape[:-1], out_features if transpose else in_features)


def _matmul_nf4_setup(ctx, inputs, output):
    x, inner, sizes, transpose, compile = inputs
    ctx.save_for_backward(*inner)
    ctx.sizes = sizes
    ctx.transpose = transpose
    ctx.compile = compile


def _matmul_nf4_backward(ctx, grad):
    grad_x = None
    if ctx.needs_input_grad[0]:
        inner = list(ctx.saved_tensors)
        grad_x = _matmul_nf4(grad, inner, ctx.sizes, not ctx.transpose, ctx.compile)
    return grad_x, [None] * 4, None, None, None


_matmul_nf4.register_autograd(_matmul_nf4_backward, setup_context=_matmul_nf4_setup)


def linear_nf4(x, weight, compile=None):
    """y = x W^T for an NF4Tensor W; autograd gives a gradient to x only."""
    sizes = [weight.shape[0], weight.block_size, weight.scaler_block_size]
    return _matmul_nf4(x, weight.inner(), sizes, True, compile)


# torch.load's safe (weights_only) unpickler must be told that the class may be rebuilt.
torch.serialization.add_safe_globals([NF4Tensor])


# -----------------------------------------------------------------------------
# 4. LoRA over a frozen NF4 base (QLoRA)
# -----------------------------------------------------------------------------
# Needs: import math, torch, torch.nn as nn, torch.nn.functional as F; from above:
# NF4Tensor, to_nf4, linear_nf4.
#
# y = x W^T + (alpha / rank) * dropout(x) A^T B^T, with W (out, in) frozen in NF4, A
# (rank, in) and B (out, rank). B starts at zero, so the model starts as the base (Hu et
# al. 2021). The adapters are fp32, cast to the compute dtype in forward (when sharded: at
# the all-gather).


def random_weight(shape, generator=None):
    """N(0, 1/in) for an (out, in) weight with no checkpoint, on the generator's device."""
    device = generator.device if generator is not None else None
    return torch.randn(shape, generator=generator, device=device) * shape[-1] ** -0.5


def lora_A_init(shape, generator=None):
    """LoRA's A (rank, in) as PEFT draws it: kaiming-uniform(a=sqrt(5)), U(+-1/sqrt(in))."""
    return (torch.rand(shape, generator=generator) * 2 - 1) / math.sqrt(shape[-1])


class NF4Linear(nn.Module):
    """A frozen linear layer, y = x W^T (+ bias, frozen), W an NF4Tensor: random unless
    given (a checkpoint's, from_linear's). compile: for its NF4 kernels (section 2)."""

    def __init__(
        self, in_features, out_features, bias=False, dtype=torch.bfloat16, compile=None, weight=None
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # The NF4 kernels' switch (`compile` itself is nn.Module.compile).
        self.compile_kernels = compile
        if weight is None:
            weight = random_weight((out_features, in_features))
        weight = to_nf4(weight.detach().to(dtype), compile=compile)
        self.weight = nn.Parameter(weight, requires_grad=False)
        zeros = torch.zeros(out_features, dtype=dtype)
        self.bias = nn.Parameter(zeros, requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear, *args, compile=None, **kw):
        """This class around an existing nn.Linear, with nothing drawn at random: its weight
        quantized (reporting its dtype), its bias kept, both frozen. args, kw: the rest of
        the constructor's (LoRALinear's rank, alpha, dropout)."""
        weight = linear.weight
        shape = (linear.in_features, linear.out_features)
        module = cls(*shape, *args, dtype=weight.dtype, compile=compile, weight=weight, **kw)
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return module

    def forward(self, x):
        y = linear_nf4(x, self.weight, self.compile_kernels)
        return y if self.bias is None else y + self.bias

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A dense weight (a checkpoint's) is quantized on the way in; this also serves
        # assign=True, which puts the given tensor in place as it is.
        key = prefix + "weight"
        if key in state_dict and not isinstance(state_dict[key], NF4Tensor):
            dense = state_dict[key].to(self.weight.dtype)
            state_dict[key] = to_nf4(dense, compile=self.compile_kernels)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class LoRALinear(NF4Linear):
    """QLoRA's layer: NF4Linear's frozen W (and bias; kw: its keywords) plus trainable fp32
    lora_A (rank, in), drawn from torch's global RNG, and lora_B (out, rank), 0."""

    def __init__(self, in_features, out_features, rank=8, alpha=16.0, dropout=0.0, **kw):
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        super().__init__(in_features, out_features, **kw)
        self.rank = rank
        self.scaling = alpha / rank
        self.lora_A = nn.Parameter(lora_A_init((rank, in_features)))  # fp32
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x, xA=None):
        """x (..., in) -> (..., out). xA: dropout(x) A^T, if the caller made it already."""
        if xA is None:
            xA = F.linear(self.dropout(x), self.lora_A.to(x.dtype))  # (..., rank)
        y = linear_nf4(x, self.weight, self.compile_kernels)  # (..., out)
        # y + scaling * xA B^T as one addmm: a compiled backward that recomputes it then
        # keeps the (..., out) sum alone.
        y2d = y.view(-1, y.shape[-1])
        xA2d = xA.view(-1, self.rank)
        B = self.lora_B.to(x.dtype)
        y = torch.addmm(y2d, xA2d, B.T, alpha=self.scaling).view(y.shape)
        return y if self.bias is None else y + self.bias

    def merged_weight(self, dtype=torch.float32):
        """W + (alpha/rank) B A, dense: what to export for serving without adapters."""
        delta = self.lora_B.float() @ self.lora_A.float()
        w = self.weight.dequantize(torch.float32) + self.scaling * delta
        return w.to(dtype)


# -----------------------------------------------------------------------------
# 5. Sharding and offload: FSDP2's idea written out on torch.distributed
# -----------------------------------------------------------------------------
# Needs: import contextlib, enum, itertools, math, torch, torch.distributed as dist,
# torch.nn as nn, torch.nn.functional as F, torch.utils._pytree as pytree; from typing import
# NamedTuple, Optional.
#
# The model is cut into *units*, as FSDP2's fully_shard cuts it: for Llama the embeddings,
# each block, and the final norm with lm_head. Only the unit that runs has its full
# weights; otherwise each rank holds its *piece* of each tensor: the tensor flattened and
# cut into `world` pieces of ceil(numel / world), zero padded (FSDP2 cuts dim 0: the same
# row-major pieces). An NF4 weight comes apart into its inner tensors, each cut in its own
# dtype; a trainable tensor keeps an fp32 master piece, cast at each all-gather. One
# collective moves a unit's pieces, side by side in one byte buffer:
#
#   rank r's shard bytes  [ q.scale_factor | ... | norm.w | q.packed | ... | q.lora_A | ... ]
#        \__ all-gather __/
#   gathered (world, unit_bytes) -> one split_with_sizes_copy: each tensor's columns into
#   its (world, shard bytes) block of the unit's full storage -> the full tensors
#
# Why per parameter, as FSDP2 and not as FSDP1: FSDP1 flattens a unit's parameters into one
# FlatParameter of one dtype, and an NF4 weight is four tensors of three dtypes (uint8 codes,
# int8 scales, fp32 factors) whose bits must not be cast. Cut tensor by tensor, each keeps its
# dtype, and only the bytes travel together.
#
# A unit's life, run by hooks on its modules, is four states (FSDP2's TrainingState). A *pass*
# is one forward through the unit, each of its modules called once; a module called again
# begins another pass, and so does each forward of the whole model.
#
#   IDLE      -> pre-forward: gather (its all-gather issued early, a prefetch), prefetch the
#                next unit; a pass's first call passes its inputs that need a gradient
#                through _PostBackward. Once each module of the pass ran: free (the storage
#                resized to 0), but the last unit, needed at once by backward.
#   WAITING   an output of a forward needs a gradient: a backward will come.
#   BACKWARD  a gradient reached an output (a hook): gathered again, the unit before
#             prefetched. When the gradient of the pass's first inputs is made (its
#             _PostBackward node), every call of the pass is done: reduce-scatter the adapters'
#             gradients in fp32, free.
#   REDUCED   reduced in this backward; another pass's output gradient -> BACKWARD again.
#   the end of backward (a callback on the autograd engine): a unit still in BACKWARD, whose
#             pass made no node (the embedding's input needs no gradient), reduces; each
#             reduced piece is added to its parameter's .grad (several backward() calls add
#             up); every unit is freed and IDLE.
#
# The parameters in no unit form the root unit, gathered for the whole forward.
# CPU offload keeps the shards, the masters, their gradients and the optimizer on the host:
# plain tensors, not DTensors, whose dispatch every optimizer op would pay (section 6).


class _Slot:
    """One tensor of a unit, cut into `world` pieces of shard_numel elements of `dtype`. The
    unit sets where the piece starts in its shard bytes (offset; a trainable one's start in the
    master), this rank's piece (local), and the full tensor (full, a view of the gathered
    storage, which padded_bytes views as (world, nbytes) bytes)."""

    def __init__(self, name, tensor, dtype, trainable, world, rank):
        self.name = name
        self.shape = tuple(tensor.shape)
        self.dtype = dtype
        self.trainable = trainable
        self.rank = rank
        self.numel = tensor.numel()
        self.shard_numel = -(-self.numel // world)  # ceil
        if not trainable:
            # Padded to 16 bytes, so that the piece after it starts aligned. (A trainable
            # piece cannot be: the reduce-scatter's chunk-cat fixes its size.)
            per_16_bytes = 16 // math.gcd(16, dtype.itemsize)
            self.shard_numel = -(-self.shard_numel // per_16_bytes) * per_16_bytes
        self.nbytes = self.shard_numel * dtype.itemsize

    def piece(self, full):
        """This rank's piece of a full tensor of this shape: flat, zero padded."""
        flat = full.detach().reshape(-1)
        begin = self.rank * self.shard_numel
        mine = flat[begin : begin + self.shard_numel]
        return F.pad(mine, (0, self.shard_numel - mine.numel()))


class _Param:
    """A parameter as slots (a subclass: one per inner tensor), and the places holding it."""

    def __init__(self, fqn, places, p, fsdp):
        self.fqn = fqn
        self.places = places
        self.shape = tuple(p.shape)
        self.subclass = hasattr(p, "__tensor_flatten__")
        self.trainable = p.requires_grad and not self.subclass
        if self.subclass:
            # What rebuilds it, never p itself: the unit must not keep the original alive.
            self.inner_names, self.flatten_meta = p.__tensor_flatten__()
            self.cls = type(p)
            self.stride = p.stride()
        names = [f"{fqn}.{inner}" for inner in self.inner_names] if self.subclass else [fqn]
        self.slots = []
        for name, t in zip(names, self.flatten(p)):
            dtype = t.dtype
            if t.is_floating_point() and not self.subclass:
                dtype = fsdp.compute_dtype or dtype
            self.slots.append(_Slot(name, t, dtype, self.trainable, fsdp.world, fsdp.rank))

    def flatten(self, t):
        if self.subclass:
            return [getattr(t, inner) for inner in self.inner_names]
        return [t]

    def unflatten(self, tensors):
        if not self.subclass:
            return tensors[0]
        inner = dict(zip(self.inner_names, tensors))
        return self.cls.__tensor_unflatten__(inner, self.flatten_meta, self.shape, self.stride)

    @torch.no_grad()
    def keep(self, full):
        """Keep this rank's pieces of a full tensor in this parameter's form."""
        for slot, t in zip(self.slots, self.flatten(full)):
            slot.local.copy_(slot.piece(t))


def _layout_order(slot):
    """Frozen slots first (each 16 bytes aligned), then trainable ones by dtype, wider first
    (each aligned; those of one dtype together, for one cast)."""
    return (slot.trainable, -slot.dtype.itemsize, str(slot.dtype))


class _AllGather(NamedTuple):
    work: Optional[dist.Work]  # in flight (None without a process group)
    output: torch.Tensor


class _Reduction(NamedTuple):
    reached: list  # the unit's trainable slots that a gradient reached
    work: Optional[dist.Work]  # in flight; its input is held until it is done
    output: torch.Tensor  # a reduce-scatter's: laid out as the unit's master
    input: Optional[torch.Tensor]


def _collective(out, inp, group, reduce_scatter=False):
    """Issue an all-gather (out: every rank's inp) or a reduce-scatter; return its work."""
    if not dist.is_initialized():
        out.copy_(inp)
        return None
    # The *_single names are torch 2.13's; the old ones warn there.
    if reduce_scatter:
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        op = dist.ReduceOp.AVG if _averages(group) else dist.ReduceOp.SUM
        return scatter(out, inp, op=op, group=group, async_op=True)
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    return gather(out, inp, group=group, async_op=True)


def _averages(group):
    """Whether a reduce-scatter averages over ranks itself: NCCL's AVG (gloo: SUM only)."""
    return not dist.is_initialized() or dist.get_backend(group) == "nccl"


@contextlib.contextmanager
def _side(stream):
    """The `with` body's work on the side `stream`, after what the compute stream queued."""
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


def _to_host(t, stream):
    """A host copy of t, pinned, made on `stream` (t recorded there: not reused early)."""
    with _side(stream):
        if t.is_cuda:
            t.record_stream(stream)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        return host.copy_(t, non_blocking=True)


class _PostBackward(torch.autograd.Function):
    """The identity on a pass's first inputs, whose backward says that the pass's is over."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # no gradient: None, not a tensor of zeros
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward()
        return (None,) + grads


class State(enum.Enum):
    """Where a unit is in its life (the comment above)."""

    IDLE = "idle"
    WAITING = "waiting for its backward"
    BACKWARD = "in backward"
    REDUCED = "reduced in this backward"


class ShardedUnit:
    """The parameters of some modules, sharded; hooks on the modules gather and free them.
    index: the place in forward's order; -1 is the root unit (the model's other parameters)."""

    def __init__(self, fsdp, index, name, modules, params, reshard_after_forward):
        self.fsdp = fsdp
        self.index = index
        self.name = name
        self.modules = modules
        self.reshard_after_forward = reshard_after_forward
        self.params = [_Param(fqn, places, p, fsdp) for fqn, places, p in params]
        self.slots = sorted([s for p in self.params for s in p.slots], key=_layout_order)
        self.adapters = [slot for slot in self.slots if slot.trainable]
        self._allocate()
        self._take_over([p for _, _, p in params])
        self.state = State.IDLE
        self.to_run = set()  # the modules of the pass under way not called yet
        self.gathered = False  # the full tensors exist
        self.inflight = None  # its all-gather in flight, an _AllGather
        self.version = None  # _version() when it was gathered or prefetched
        for m in modules:
            m.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            m.register_forward_hook(self._post_forward)

    def _allocate(self):
        """Each slot's offset in the shard bytes (a trainable one's start in the master); the
        shard bytes and fp32 master, and the full tensors as views of one storage."""
        self.unit_bytes = 0
        self.master_numel = 0
        for slot in self.slots:
            slot.offset = self.unit_bytes
            self.unit_bytes += slot.nbytes
            if slot.trainable:
                slot.start = self.master_numel
                self.master_numel += slot.shard_numel
        fsdp = self.fsdp
        world = fsdp.world
        device = fsdp.device
        # Offloaded, the host's tensors are pinned: the GPU copies them asynchronously.
        on = dict(device=fsdp.store_device, pin_memory=fsdp.offload and device.type == "cuda")
        self.shard_bytes = torch.zeros(self.unit_bytes, dtype=torch.uint8, **on)
        # The fp32 master: this rank's trainable pieces, laid out as a row of the
        # reduce-scatter's input. Its padding stays 0.
        self.master = torch.zeros(self.master_numel, **on) if self.master_numel else None
        # The full tensors: (world, shard bytes) blocks of one storage, empty until gathered.
        flat = torch.empty(world * self.unit_bytes, dtype=torch.uint8, device=device)
        self.storage = flat.untyped_storage()
        for slot in self.slots:
            if slot.trainable:  # a view of the master, a parameter of its own
                slot.local = nn.Parameter(self.master.narrow(0, slot.start, slot.shard_numel))
            else:
                slot.local = self.shard_bytes.narrow(0, slot.offset, slot.nbytes).view(slot.dtype)
            slot.full = torch.empty(0, dtype=slot.dtype, device=device)
            slot.full.set_(self.storage, world * slot.offset // slot.dtype.itemsize, slot.shape)
            slot.full.requires_grad_(slot.trainable)
            slot.padded_bytes = torch.empty(0, dtype=torch.uint8, device=device)
            slot.padded_bytes.set_(self.storage, world * slot.offset, (world, slot.nbytes))
        self.storage.resize_(0)

    def _take_over(self, originals):
        """The parameters give way to this rank's pieces, and to full ones when gathered. A
        trainable one's piece takes its place on its module, under its name, as with
        fully_shard: the optimizer steps the pieces. A frozen one leaves its module."""
        self.places = []
        for p, original in zip(self.params, originals):
            if original.device.type != "meta":  # on "meta": loaded later (section 14)
                p.keep(original)
            p.value = p.unflatten([slot.full for slot in p.slots])  # the full parameter
            for module, attr in p.places:
                module._parameters.pop(attr, None)
                if p.trainable:
                    module._parameters[attr] = p.slots[0].local
                self.places.append((module, attr, p.value))

    def _version(self):
        """Moves whenever this rank's pieces are written (an optimizer step, a load)."""
        return self.shard_bytes._version, getattr(self.master, "_version", None)

    def prefetch(self):
        """Issue this unit's all-gather, unless it is gathered or in flight already."""
        fsdp = self.fsdp
        if self.gathered or self.inflight is not None or not self.slots:
            return
        # The receive buffer belongs to the compute stream, which reads and frees it.
        out = torch.empty(fsdp.world * self.unit_bytes, dtype=torch.uint8, device=fsdp.device)
        # On the side stream, after the optimizer's last update: the shard's copy to the
        # GPU (with offload), the masters' cast, the all-gather, overlapping compute.
        with _side(fsdp.side_stream), torch.profiler.record_function("fsdp::all_gather"):
            send = self.shard_bytes.to(fsdp.device, non_blocking=True)
            self._cast_masters(send)
            work = _collective(out, send, fsdp.group)
        self.inflight = _AllGather(work, out)
        self.version = self._version()

    def _cast_masters(self, send):
        """The fp32 masters into the bytes to send, one cast per dtype (side by side)."""
        for dtype, run in itertools.groupby(self.adapters, key=lambda slot: slot.dtype):
            run = list(run)
            wire = send[run[0].offset : run[-1].offset + run[-1].nbytes].view(dtype)
            master = self.master[run[0].start : run[-1].start + run[-1].shard_numel]
            # Offloaded, the pinned fp32 run is copied as it is, then cast on the GPU: a
            # copy_ that changed both would cast on the host, into pageable memory.
            wire.copy_(master.to(wire.device, non_blocking=True), non_blocking=True)

    def gather(self):
        """The full tensors on their modules, copied out of the unit's all-gather in one op."""
        if self.version is not None and self.version != self._version():
            self.free()  # gathered or prefetched before its pieces were written (a step)
        if self.gathered or not self.slots:
            return
        self.prefetch()
        self.fsdp.wait(self.inflight.work, "fsdp::wait_all_gather")
        world = self.fsdp.world
        with torch.no_grad(), torch.profiler.record_function("fsdp::copy_out"):
            self.storage.resize_(world * self.unit_bytes)
            torch.split_with_sizes_copy(
                self.inflight.output.view(world, self.unit_bytes),
                [slot.nbytes for slot in self.slots],
                dim=1,
                out=[slot.padded_bytes for slot in self.slots],
            )
        self.inflight = None  # the receive buffer goes
        for module, attr, value in self.places:
            module.__dict__[attr] = value  # as long as the full tensors exist
        # A trainable tensor gets a gradient only while its parameter asks for one.
        for slot in self.adapters:
            slot.full.requires_grad_(slot.local.requires_grad)
        self.gathered = True

    def free(self):
        if self.inflight is not None:  # a prefetch that will not be used: let it finish
            self.fsdp.wait(self.inflight.work, "fsdp::wait_all_gather")
        self.inflight = None
        self.storage.resize_(0)
        for module, attr, _ in self.places:
            module.__dict__.pop(attr, None)
        self.gathered = False
        self.version = None

    # The hooks stay eager under a torch.compile'd model, as FSDP2's: torch.compiler.disable,
    # in the form torch uses itself, which imports the compiler at the first call, not here.
    @torch._disable_dynamo
    def _pre_forward(self, module, args, kwargs):
        self.gather()
        # A recompute inside backward (a checkpoint around the module) needs the weights
        # only: its backward was set up by the forward it repeats.
        if torch._C._current_graph_task_id() != -1:
            return args, kwargs
        units = self.fsdp.units
        if self.index < 0:  # the root: a new forward of the whole model, a new pass everywhere
            args, kwargs = self.fsdp.cast_inputs(args, kwargs)
            for unit in self.fsdp.all_units:
                unit.to_run = set()
        if self.index + 1 < len(units):
            units[self.index + 1].prefetch()  # it overlaps this unit's compute
        if module in self.to_run:
            return args, kwargs  # the pass goes on
        # A pass begins: its first inputs that need a gradient go through _PostBackward.
        self.to_run = set(self.modules)
        if not torch.is_grad_enabled():
            return args, kwargs
        leaves, spec = pytree.tree_flatten((args, kwargs))
        need = [i for i, t in enumerate(leaves) if torch.is_tensor(t) and t.requires_grad]
        wrapped = _PostBackward.apply(self, *(leaves[i] for i in need)) if need else ()
        for i, t in zip(need, wrapped):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, spec)

    @torch._disable_dynamo
    def _post_forward(self, module, args, output):
        if torch._C._current_graph_task_id() != -1:  # a recompute
            return None
        self.to_run.discard(module)
        if torch.is_grad_enabled():
            for t in pytree.tree_leaves(output):
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._pre_backward)
                    self.state = State.WAITING
        # Once each module has run, the pass is over: free, unless backward needs the unit
        # at once. A module that does not run keeps the unit gathered until backward ends.
        if not self.to_run and (self.reshard_after_forward or not torch.is_grad_enabled()):
            self.free()
        return None

    def _pre_backward(self, grad):
        self.fsdp.queue_end_of_backward()
        if self.state == State.BACKWARD:
            return
        self.state = State.BACKWARD
        self.gather()  # again if a reduction in this backward freed it
        previous = self.fsdp.units[self.index - 1] if self.index > 0 else None
        if previous is not None and previous.state == State.WAITING:
            previous.prefetch()  # the unit whose backward comes next

    def post_backward(self):
        """Reduce-scatter the gradients that reached the full tensors, free. A unit may reduce
        more than once in a backward (a module called twice, a pass that made no node): each
        reduction is added, zeros standing in for a slot that another reduction reached."""
        grads = [slot.full.grad for slot in self.adapters]
        reached = [slot for slot, g in zip(self.adapters, grads) if g is not None]
        if reached:
            filled = [
                torch.zeros_like(s.full) if g is None else g for s, g in zip(self.adapters, grads)
            ]
            for slot in self.adapters:
                slot.full.grad = None
            self.fsdp.reduce(self, filled, reached)
        self.free()
        self.state = State.REDUCED


def _find_params(model, groups):
    """{id(parameter): (name, [(module, attribute)], parameter, unit)} of every parameter of
    model: its unit is that of the nearest module around it that a unit lists, -1 (the root)
    where none does. A parameter held in several places of one unit (tied) lists each; held
    in two units, or in a unit that lists a module and one inside it, it is refused."""
    owner = {m: i for i, group in enumerate(groups) for m in group}
    found = {}

    def visit(module, prefix, unit, top=""):
        if module in owner:
            if owner[module] == unit:
                raise ValueError(
                    f"FSDP: a unit lists {prefix[:-1]} and {top}, which holds it; list only {top}"
                )
            unit = owner[module]
            top = prefix[:-1]
        for attr, p in module._parameters.items():
            if p is None:
                continue
            fqn, places, _, p_unit = found.setdefault(id(p), (prefix + attr, [], p, unit))
            if p_unit != unit:
                raise ValueError(
                    f"FSDP: parameter {prefix + attr} (also {fqn}) is in two units; "
                    f"put the modules that share it in one unit"
                )
            places.append((module, attr))
        for name, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.", unit, top)

    visit(model, "", -1)
    return found


class FullyShard:
    """Shards a model's units over `group`, as FSDP2's fully_shard does, in plain tensors.

    units: in forward's order, each a module or a list of modules gathered together; every
    other parameter of `model` forms the root unit, gathered for the whole forward.
    compute_dtype (FSDP2's param_dtype): frozen floating tensors are kept and gathered in it,
    trainable ones gathered in it from fp32 masters, the root's floating inputs cast to it
    (FSDP2's cast_forward_inputs); gradients reduce in fp32. offload: shards, masters and
    AdamW on the host.

        fsdp = FullyShard(model, model.units(), "cuda", torch.bfloat16)
        optimizer = ForeachAdamW(fsdp.parameters())  # the pieces: make it after sharding
        model(x, y).backward()  # under torchrun: dist.init_process_group() first
        fsdp.clip_grad_norm_(1.0)  # over all ranks (torch's would see this rank's pieces)
        optimizer.step()
    """

    def __init__(self, model, units, device, compute_dtype=None, offload=False, group=None):
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.offload = offload
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.store_device = torch.device("cpu") if offload else self.device
        self.pending = None  # the reduce-scatter in flight, a _Reduction
        self.arrived = []  # reduced gradient pieces to add at the end of backward
        self.task = None  # the backward pass whose end is queued
        # On CUDA the all-gathers (offloaded: after the shards' copies to the GPU) go on a side
        # stream, to overlap compute.
        cuda = self.device.type == "cuda"
        self.side_stream = torch.cuda.Stream(self.device) if cuda else None
        # Offloaded gradients go to the host on a stream of their own: queued behind them, the
        # next unit's all-gather would wait for the copy.
        self.offload_stream = torch.cuda.Stream(self.device) if cuda and offload else None
        groups = [[u] if isinstance(u, nn.Module) else list(u) for u in units]
        names = {m: name for name, m in model.named_modules()}
        outside = [type(m).__name__ for group in groups for m in group if m not in names]
        if outside:
            raise ValueError(f"FSDP: a unit's {outside[0]} is not a submodule of the model")
        params = {i: [] for i in range(-1, len(groups))}
        for fqn, places, p, unit in _find_params(model, groups).values():
            params[unit].append((fqn, places, p))
        self.root = ShardedUnit(self, -1, "root", [model], params[-1], False)
        self.units = []
        for i, group in enumerate(groups):
            name = "+".join(names[m] for m in group)
            # The last unit is needed at once by backward: it keeps its weights after forward.
            last = i == len(groups) - 1
            self.units.append(ShardedUnit(self, i, name, group, params[i], not last))
        self.all_units = [self.root] + self.units
        self.trained = [u for u in self.all_units if u.master is not None]

    def parameters(self):
        """The trainable parameters: this rank's pieces, as model.parameters() gives them."""
        return [p for _, p in self.named_parameters()]

    def named_parameters(self):
        """(name, piece) of every trainable parameter, in the order of the units' layouts."""
        return [(s.name, s.local) for unit in self.trained for s in unit.adapters]

    def cast_inputs(self, args, kwargs):
        """The root's floating-point inputs in compute_dtype (FSDP2's cast_forward_inputs)."""
        dtype = self.compute_dtype
        if dtype is None:
            return args, kwargs

        def cast(t):
            return t.to(dtype) if t.is_floating_point() else t

        return pytree.tree_map_only(torch.Tensor, cast, (args, kwargs))

    def queue_end_of_backward(self):
        """Queue _end_of_backward on the autograd engine, once per backward, from inside it."""
        task = torch._C._current_graph_task_id()
        if task != self.task:
            self.task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self):
        """Reduce every unit still in backward (one whose pass made no node; the root), add each
        reduced piece to its .grad (a slot that no gradient reached keeps None), free every
        unit."""
        self.task = None
        for unit in self.all_units:
            if unit.state == State.BACKWARD:
                unit.post_backward()
            unit.state = State.IDLE
        self._finish_reduction()
        if self.offload_stream is not None:
            self.offload_stream.synchronize()  # the host reads these gradients next
        for arrived in self.arrived:
            for slot in arrived.reached:
                grad = arrived.output[slot.start : slot.start + slot.shard_numel]
                if slot.local.grad is None:  # a view of the reduction
                    slot.local.grad = grad
                else:
                    slot.local.grad.add_(grad)
        self.arrived = []
        self.reshard()

    def reduce(self, unit, grads, reached):
        """Issue unit's fp32 reduce-scatter of grads (one per trainable slot; `reached`: the
        slots a gradient reached), one at a time; its input (world, master numel), row r laid
        out as rank r's master, made by one chunk-cat."""
        self._finish_reduction()
        with torch.no_grad(), torch.profiler.record_function("fsdp::reduce_scatter"):
            f32 = dict(dtype=torch.float32, device=self.device)
            send = torch.empty(self.world, unit.master_numel, **f32)
            flat_grads = [g.reshape(-1) for g in grads]
            torch._chunk_cat(flat_grads, dim=0, num_chunks=self.world, out=send)
            out = torch.empty(unit.master_numel, **f32)
            work = _collective(out, send.view(-1), self.group, reduce_scatter=True)
            self.pending = _Reduction(reached, work, out, send)

    def _finish_reduction(self):
        """Wait for the reduce-scatter in flight; its piece is added at the end of backward."""
        if self.pending is None:
            return
        pending = self.pending
        self.pending = None
        self.wait(pending.work, "fsdp::wait_reduce_scatter")
        grad = self.reduced(pending.output)
        if self.offload and grad.is_cuda:  # to the host as soon as it is reduced
            grad = _to_host(grad, self.offload_stream)
        self.arrived.append(pending._replace(work=None, output=grad, input=None))

    def reduced(self, grad):
        """A reduce-scatter's output as the mean over ranks, as FSDP2's gradients."""
        if not _averages(self.group):
            grad.div_(self.world)  # gloo summed
        return grad

    def wait(self, work, label):
        """Wait for a collective: on CUDA the compute stream waits, on the CPU the host."""
        with torch.profiler.record_function(label):
            if work is not None:
                # NCCL: the compute stream waits for the collective and for what came
                # before it on its stream (the shard's copy to the GPU, the masters' cast).
                work.wait()
            elif self.side_stream is not None:
                # No process group: the "collective" was a copy on the side stream.
                torch.cuda.current_stream(self.device).wait_stream(self.side_stream)

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """clip_grad_norm_ over all ranks' pieces: the ranks' sums of |g|^p (for inf the max)
        make the norm."""
        p = float(norm_type)
        grads = [piece.grad for piece in self.parameters() if piece.grad is not None]
        local = torch.nn.utils.get_total_norm(grads, p).to(self.device)
        inf = p == math.inf
        total = local if inf else local**p
        if dist.is_initialized():
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            dist.all_reduce(total, op=op, group=self.group)
        norm = total if inf else total ** (1.0 / p)
        torch.nn.utils.clip_grads_with_norm_(self.parameters(), max_norm, norm)
        return norm

    def reshard(self):  # free every unit still gathered
        for unit in self.all_units:
            unit.free()


# -----------------------------------------------------------------------------
# 6. AdamW on torch._foreach_* ops
# -----------------------------------------------------------------------------
# Needs: import math, torch.
#
# torch.optim.AdamW over FSDP2's DTensors pays Python and DTensor dispatch per tensor per
# op. The pieces of section 5 are plain tensors (Llama-2-7B: 448 adapter pieces per rank),
# and each op below is one foreach call over all of them: one kernel launch per op on a
# GPU. With decoupled weight decay:
#   p <- p (1 - lr wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
#   p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)


class ForeachAdamW(torch.optim.Optimizer):
    """AdamW on torch._foreach_* ops, equal to torch.optim.AdamW up to rounding."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _advance(self, params):
        """Each parameter's step count moves on by one; a new one gets its state first."""
        for p in params:
            state = self.state[p]
            if not state:
                state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] = int(state["step"]) + 1  # torch's state_dict holds it as a tensor

    def _chunks(self, params):
        """Lists of params that share their step count (one without a gradient at some step
        lags behind), each stepped in one foreach run."""
        chunks = {}
        for p in params:
            chunks.setdefault(self.state[p]["step"], []).append(p)
        return list(chunks.values())

    @torch.no_grad()
    def step(self):
        """One update of every parameter that has a gradient."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            self._advance(params)
            for chunk in self._chunks(params):
                self._update(chunk, group)

    def _update(self, params, group):
        lr = float(group["lr"])  # a tensor lr too
        beta1, beta2 = map(float, group["betas"])
        eps = float(group["eps"])
        weight_decay = float(group["weight_decay"])
        step = self.state[params[0]]["step"]
        grads = [p.grad for p in params]
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
        # The bias corrections of m and of sqrt(v).
        c1 = 1 - beta1**step
        c2 = math.sqrt(1 - beta2**step)
        if weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        # c2 is folded into the constants, a pass fewer:
        # m / (sqrt(v) / c2 + eps) = c2 m / (sqrt(v) + eps c2).
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denom, eps * c2)
        torch._foreach_addcdiv_(params, exp_avgs, denom, -lr * c2 / c1)


# -----------------------------------------------------------------------------
# 7. Llama, module for module as Hugging Face's LlamaForCausalLM
# -----------------------------------------------------------------------------
# Needs: import math, torch, torch.nn as nn, torch.nn.functional as F; from dataclasses
# import dataclass; from typing import Optional; from torch.utils.checkpoint import
# checkpoint; from above: use_compiled, compile_dynamic, NF4Tensor, LoRALinear, random_weight.


@dataclass
class LlamaConfig:
    """A Llama's shape; the field names are those of Hugging Face's config.json."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None  # None: as many as attention heads (no GQA)
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    head_dim: Optional[int] = None  # None: hidden_size / num_attention_heads

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    def rope_inv_freq(self):
        """RoPE's frequencies, theta^(-2i/d) for i < d/2 (d: head_dim)."""
        d = self.head_dim
        exponents = torch.arange(0, d, 2, dtype=torch.float64) / d
        return (1.0 / self.rope_theta**exponents).float()


# One line per size (Llama 2: Touvron et al. 2023; Llama 3: Meta 2024), the fields vocab_size,
# hidden_size, intermediate_size, layers, heads, kv heads, context.
CONFIGS = {
    "tiny": LlamaConfig(256, 128, 384, 4, 4, 2, 1024),
    "small": LlamaConfig(256, 256, 768, 4, 4, 4, 1024),  # the smallest torchao shards in 2
    "llama2-7b": LlamaConfig(32000, 4096, 11008, 32, 32, 32, 4096),
    "llama2-13b": LlamaConfig(32000, 5120, 13824, 40, 40, 40, 4096),
    "llama2-70b": LlamaConfig(32000, 8192, 28672, 80, 64, 8, 4096),
    "llama3-8b": LlamaConfig(128256, 4096, 14336, 32, 32, 8, 8192, rope_theta=500000.0),
    "llama3-70b": LlamaConfig(128256, 8192, 28672, 80, 64, 8, 8192, rope_theta=500000.0),
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x):
        # Normalize in fp32, scale in the compute dtype, as Hugging Face does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(config, positions, dtype):
    """cos, sin (*positions.shape, head_dim), Hugging Face's layout: the frequencies twice."""
    inv_freq = config.rope_inv_freq().to(positions.device)
    freqs = positions.float()[..., None] * inv_freq  # (..., d/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (..., d)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x (B, n_heads, T, head_dim) rotated; rotate_half splits the head dimension in two."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, c, lora):
        super().__init__()
        self.n_heads = c.num_attention_heads
        self.n_kv = c.num_key_value_heads
        self.head_dim = c.head_dim
        d = c.hidden_size
        q_dim = self.n_heads * self.head_dim
        kv_dim = self.n_kv * self.head_dim
        self.q_proj = LoRALinear(d, q_dim, **lora)
        self.k_proj = LoRALinear(d, kv_dim, **lora)
        self.v_proj = LoRALinear(d, kv_dim, **lora)
        self.o_proj = LoRALinear(q_dim, d, **lora)

    def forward(self, x, cos, sin, mask=None):
        """x (B, T, C); mask: where a query may attend, or None (causal)."""
        B, T, C = x.shape
        q, k, v = self.project(x)  # (B, T, heads, hd) each
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, nh, T, hd)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, nkv, T, hd)
        v = v.transpose(1, 2)  # (B, nkv, T, hd)
        y = self.attend(q, k, v, mask)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hd)
        return self.o_proj(y)

    def project(self, x):
        """q, k, v (B, T, heads, head_dim): the projections of x (B, T, C)."""
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        return q, k, v

    def attend(self, q, k, v, mask):
        # Grouped-query attention: each of the nkv heads serves nh / nkv query heads.
        gqa = self.n_kv != self.n_heads
        return F.scaled_dot_product_attention(q, k, v, mask, is_causal=mask is None, enable_gqa=gqa)


class LlamaMLP(nn.Module):
    def __init__(self, c, lora):
        super().__init__()
        d = c.hidden_size
        ffn = c.intermediate_size
        self.gate_proj = LoRALinear(d, ffn, **lora)
        self.up_proj = LoRALinear(d, ffn, **lora)
        self.down_proj = LoRALinear(ffn, d, **lora)

    def forward(self, x):
        # SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)).
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    # The classes a block is made of; section 11's families put their own here.
    Attention = LlamaAttention
    MLP = LlamaMLP

    def __init__(self, c, lora):
        super().__init__()
        dtype = lora["dtype"]
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = self.Attention(c, lora)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = self.MLP(c, lora)

    def forward(self, x, cos, sin, checkpointing=False, mask=None):
        if checkpointing and torch.is_grad_enabled():
            # Keep only the block's input (B, T, C) and recompute the rest in backward.
            # This sits inside forward, so that, compiled, the recompute fuses into
            # backward's kernels.
            return checkpoint(self.block, x, cos, sin, mask, use_reentrant=False)
        return self.block(x, cos, sin, mask)

    def block(self, x, cos, sin, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


IGNORE_INDEX = -100  # a target that does not count (F.cross_entropy's default ignore_index)


def _cross_entropy_rows(logits, targets, need_grad: bool):
    """logits (n, V), targets (n,) -> the fp32 sum of the counted rows' losses and, if
    need_grad, its gradient softmax - onehot (0 on ignored rows), made in place."""
    keep = (targets != IGNORE_INDEX)[:, None]  # (n, 1)
    # Ignored rows look up class 0 and count 0.
    t = targets.masked_fill(targets == IGNORE_INDEX, 0)[:, None]
    x = logits.float()
    target_logit = x.gather(1, t)
    m = x.amax(dim=-1, keepdim=True)
    sumexp = x.sub_(m).exp_().sum(dim=-1, keepdim=True)  # x now holds exp(l - max)
    loss = torch.where(keep, m + sumexp.log() - target_logit, 0.0).sum()
    if not need_grad:
        return loss, None
    onehot = torch.arange(x.shape[1], device=x.device) == t  # (n, V)
    grad = x.div_(sumexp).add_(onehot, alpha=-1).mul_(keep)
    return loss, grad.to(logits.dtype)


_cross_entropy_rows_compiled = compile_dynamic(_cross_entropy_rows)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Cross entropy of h W^T, `chunk` rows at a time. Llama-2-7B's logits at T=2048 are
    131 MB per sequence in bf16, as many their gradient; here one chunk's exist at a time.
    Forward makes each chunk's loss AND gradient wrt h, (softmax - onehot) W; backward
    scales it. (W, frozen, gets no gradient.)"""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, reduction, compile):
        # h (N, C), weight (V, C), targets (N,)
        if isinstance(weight, NF4Tensor):  # an NF4 head (section 11)
            W = weight.dequantize(h.dtype, compile)
        else:
            W = weight.to(h.dtype)
        need_grad = ctx.needs_input_grad[0]
        compiled = use_compiled(compile, h)
        rows = _cross_entropy_rows_compiled if compiled else _cross_entropy_rows
        grad_h = torch.empty_like(h) if need_grad else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            logits = h[s : s + chunk] @ W.T  # (n, V)
            loss, grad_logits = rows(logits, targets[s : s + chunk], need_grad)
            del logits
            total += loss
            if need_grad:  # (n, C), not (n, V)
                torch.mm(grad_logits, W, out=grad_h[s : s + chunk])
            # Freed before the next chunk's logits exist: one chunk alive, not two.
            del grad_logits
        # "mean" is over the counted targets; none counted gives 0, not 0/0.
        ctx.denominator = 1
        if reduction == "mean":
            ctx.denominator = (targets != IGNORE_INDEX).sum().clamp(min=1)
        ctx.save_for_backward(grad_h)
        return total / ctx.denominator

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_h,) = ctx.saved_tensors
        scale = (grad_loss / ctx.denominator).to(grad_h.dtype)
        return grad_h * scale, None, None, None, None, None


LOSS_CHUNK = 1024  # rows of logits alive at once in the loss


def chunked_cross_entropy(h, weight, targets, chunk=LOSS_CHUNK, reduction="mean", compile=None):
    """F.cross_entropy(h @ weight.T, targets, ignore_index=IGNORE_INDEX, reduction=...),
    "mean" (0 over no target) or "sum", without the full logits."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    # Checked here, as F.cross_entropy checks: the compiled kernel's own bounds check
    # would abort the process from inside a parallel loop.
    in_range = (targets >= 0) & (targets < weight.shape[0])
    ok = (in_range | (targets == IGNORE_INDEX)).all()
    message = "chunked_cross_entropy: a target is outside [0, vocab) and not IGNORE_INDEX"
    torch._assert_async(ok, message)
    return _ChunkedCrossEntropy.apply(h, weight, targets, chunk, reduction, compile)


class LMHead(nn.Module):
    """lm_head: the logits, or the chunked cross entropy. Frozen and dense, as bitsandbytes
    (through transformers), torchtune and Unsloth keep it: 2% of a 7B, dense in the loss
    anyway, and in NF4 it costs accuracy (README)."""

    def __init__(self, in_features, out_features, dtype, compile=None):
        super().__init__()
        self.compile_kernels = compile
        weight = random_weight((out_features, in_features)).to(dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, h, targets=None, reduction="mean"):
        # h (B, T, C), targets (B, T)
        if targets is None:
            return F.linear(h, self.weight)  # (B, T, vocab)
        h = h.flatten(0, -2)
        targets = targets.reshape(-1)
        kw = dict(reduction=reduction, compile=self.compile_kernels)
        return chunked_cross_entropy(h, self.weight, targets, **kw)


class Llama(nn.Module):
    """LlamaForCausalLM, every projection a LoRALinear over NF4. compile: for the NF4
    kernels and the loss (section 2)."""

    Block = LlamaDecoderLayer  # section 11's families put their own here

    def __init__(
        self,
        config,
        dtype=torch.bfloat16,
        lora_rank=8,
        lora_alpha=16.0,
        lora_dropout=0.0,
        compile=None,
    ):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.checkpointing = True  # activation checkpointing per block
        lora = dict(rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout)
        lora.update(dtype=dtype, compile=compile)
        c = config
        # A container that gives Hugging Face's "model." names; forward runs it.
        self.model = nn.Module()
        embed = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype).requires_grad_(False)
        self.model.embed_tokens = embed
        layers = [self.Block(c, lora) for _ in range(c.num_hidden_layers)]
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = LMHead(c.hidden_size, c.vocab_size, dtype, compile)

    def forward(self, tokens, targets=None, reduction="mean", positions=None, mask=None):
        """tokens (B, T) int64 -> logits (B, T, vocab); or, given targets, the mean (or sum) of
        the cross entropy over those that count. positions (B, T) and mask (B, 1, T, T), as
        Hugging Face's position_ids and attention_mask: 0, 1, ... and causal if not given."""
        h = self.model.embed_tokens(tokens)  # (B, T, C)
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = rope_cos_sin(self.config, positions, h.dtype)  # (T, hd)
        if positions.dim() == 2:  # (B, T): per row, broadcast over the heads
            cos = cos[:, None]
            sin = sin[:, None]
        for layer in self.model.layers:
            h = layer(h, cos, sin, self.checkpointing, mask)
        return self.lm_head(self.model.norm(h), targets, reduction)

    def units(self):
        """FSDP's units, in forward's order: the embeddings, each block, the norm and head."""
        m = self.model
        return [m.embed_tokens, *m.layers, [m.norm, self.lm_head]]


# -----------------------------------------------------------------------------
# 8. Training: a sharded model, batches, one step, the loop over steps
# -----------------------------------------------------------------------------
# Needs: import math, os, random, time, numpy as np, torch, torch.distributed as dist; from
# typing import NamedTuple, Optional; from above: sections 2-7.
#
# One code path serves any number of processes, as nanoGPT's does: torchrun sets RANK,
# WORLD_SIZE and LOCAL_RANK; a plain `python` run is a world of one. GPUs talk over NCCL,
# CPUs over gloo. `args`: any object with the fields read (the command line's, or yours).

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def print0(*args, **kwargs):
    """print, on rank 0 only: it speaks for all."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def init_distributed(cuda):
    """This process's device and, under torchrun, its process group: (device, world, rank)."""
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return (device, *world_and_rank())


def world_and_rank():
    """The number of processes and this one's rank: (1, 0) without a process group."""
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(), dist.get_rank()


def seed_of(*key):
    """A 63-bit seed of its own for each key, e.g. (seed, "batch", step): a SHA-512 of it."""
    return random.Random("/".join(map(str, key))).getrandbits(63)


def seeded(*key, device="cpu"):
    """A generator for one use, e.g. seeded(seed, "batch", step): every rank draws alike
    from it, each key a stream of its own. (A CUDA generator draws other numbers.)"""
    return torch.Generator(device).manual_seed(seed_of(*key))


def build_sharded(config, args, device, state_dict=None):
    """A Llama sharded over the ranks: (model, fsdp). Every rank builds the same model (one
    seed), or loads `state_dict` (a checkpoint's), and keeps its pieces. (Section 16 builds
    on "meta" and loads one weight at a time, for a model too big for a rank's memory.)"""
    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    lora = (args.lora_rank, args.lora_alpha, args.lora_dropout)
    model = Llama(config, dtype, *lora, compile=args.compile)
    if state_dict is not None:
        model.load_state_dict(state_dict, assign=True)  # NF4Linear quantizes its weights
    model.checkpointing = args.checkpointing
    if args.compile:  # each block's forward, its checkpoint included; hooks stay eager
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward)
    return model, FullyShard(model, model.units(), device, dtype, offload=args.cpu_offload)


class Batch(NamedTuple):
    """This rank's rows of one micro-batch, each (batch_size, seq_len)."""

    inputs: torch.Tensor
    targets: torch.Tensor  # IGNORE_INDEX where a prediction does not count
    positions: Optional[torch.Tensor] = None  # Llama.forward's (None: 0, 1, ... in each row)


def get_batch(data, step, micro, args, world, rank, vocab_size):
    """This rank's Batch of micro-batch `micro` of `step`: rows in the order (micro, rank,
    row) of a global batch that depends only on (seed, step), so any split sees the same
    rows. data: token ids (windows at random places), or None (random tokens)."""
    generator = seeded(args.seed, "batch", step)
    n = args.batch_size * args.grad_accum * world  # rows in the global batch
    T = args.seq_len
    first = (micro * world + rank) * args.batch_size
    rows = slice(first, first + args.batch_size)
    if data is None:
        tokens = torch.randint(vocab_size, (n, T + 1), generator=generator)[rows]
    else:
        starts = torch.randint(len(data) - T, (n,), generator=generator)[rows]
        windows = [data[s : s + T + 1].astype(np.int64) for s in starts.tolist()]
        tokens = torch.from_numpy(np.stack(windows))  # (batch_size, T + 1)
    return Batch(tokens[:, :-1], tokens[:, 1:])


def learning_rate(step, args):
    """A linear warmup over warmup_steps, then a cosine decay to 10% of lr at `steps`."""
    warmup = args.warmup_steps
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, args.steps - warmup))
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train_step(model, fsdp, optimizer, batches, grad_clip, device):
    """One AdamW step over this rank's micro-batches (Batches), and its loss: the mean over
    the global batch's counted targets, whatever the split into ranks and micro-batches. A
    non-finite loss skips the update."""
    batches = [Batch(*b) for b in batches]
    # The targets that count, over all ranks: the mean's denominator.
    count = sum((b.targets != IGNORE_INDEX).sum() for b in batches).to(device)
    if dist.is_initialized():
        dist.all_reduce(count)
    count = max(1, count.item())  # a batch that counts nothing: loss 0, zero gradients
    loss_sum = torch.zeros((), device=device)
    for b in batches:
        b = Batch(*(None if t is None else t.to(device) for t in b))
        with torch.profiler.record_function("forward"):
            loss = model(b.inputs, b.targets, "sum", b.positions)
        with torch.profiler.record_function("backward"):
            # Each unit's gradients are reduce-scattered as its backward ends. The
            # reductions average over ranks, so x world gives the masters d(global sum);
            # the 1 / count comes after, in fp32.
            (loss * world_and_rank()[0]).backward()
        loss_sum += loss.detach()
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
    loss = (loss_sum / count).item()  # this also waits for the device
    if math.isfinite(loss):
        with torch.profiler.record_function("optimizer"):
            # d(global sum) -> d(global mean), in fp32.
            for p in fsdp.parameters():
                if p.grad is not None:
                    p.grad.div_(count)
            if grad_clip > 0:
                fsdp.clip_grad_norm_(grad_clip)
            optimizer.step()
    # Also after a skipped step: the next one starts from no gradient.
    optimizer.zero_grad(set_to_none=True)
    return loss


class StepRecord(NamedTuple):  # what one step did, as the loop logs it
    step: int  # steps done, counted from 1
    loss: float
    lr: float
    seconds: float
    tokens: int  # in the step's global batch


def format_step(r, steps):
    return (
        f"step {r.step}/{steps} | loss {r.loss:.4f} | lr {r.lr:.1e} | "
        f"{r.seconds * 1000:.0f} ms | {r.tokens / r.seconds:,.0f} tok/s"
    )


def run_step(model, fsdp, optimizer, batches, args, device, step):
    """Step `step` (from 0) of the loop over this rank's micro-batches: its learning rate, its
    dropout masks' seed, one train_step. -> its StepRecord; a non-finite loss raises."""
    t0 = time.perf_counter()
    world, rank = world_and_rank()
    lr = learning_rate(step, args)
    for group in optimizer.param_groups:
        group["lr"] = lr
    # LoRA dropout draws its masks from (seed, rank, step): a resumed run draws alike.
    torch.manual_seed(seed_of(args.seed, "dropout", rank, step))
    loss = train_step(model, fsdp, optimizer, batches, args.grad_clip, device)
    seconds = time.perf_counter() - t0
    if not math.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} at step {step + 1}; stopped before updating")
    tokens = world * sum(b[0].numel() for b in batches)  # the global batch's, every rank alike
    return StepRecord(step + 1, loss, lr, seconds, tokens)


def train(model, fsdp, optimizer, data, args, device):
    """The training loop: args.steps steps, a line every log_every."""
    world, rank = world_and_rank()
    vocab_size = model.config.vocab_size
    records = []
    for step in range(args.steps):
        # This rank's micro-batches of the step's global batch; forward and backward over
        # each, the gradients reduced, one AdamW update.
        micros = range(args.grad_accum)
        batches = [get_batch(data, step, m, args, world, rank, vocab_size) for m in micros]
        record = run_step(model, fsdp, optimizer, batches, args, device, step)
        records.append(record)
        if step % args.log_every == 0 or step + 1 == args.steps:
            print0(format_step(record, args.steps))
    return records


# =============================================================================
# Part II: the product around the lesson. Skip it on a first read.
# =============================================================================
# Part II extends Part I's names, by subclassing, wrapping and registering: faster kernels,
# sharding for any model, the Llama family, packed documents, long context, predicting
# memory, Hugging Face files, your data, and the command line. Part I never names it.

import argparse
import bisect
import dataclasses
import datetime
import json
import logging
import re
import resource
import shlex
import shutil
import signal
import sys
import tempfile
import threading

from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# What every section of the product shares: bad input raises a UserError, which the command
# line (section 17) says in one line.


class UserError(ValueError):
    """Bad input (a file, a flag): main() prints it as one line and exits non-zero."""


def require(ok, message):
    if not ok:
        raise UserError(message)


def check_window(config, length, what):
    """Refuse `length` tokens past the model's sliding window (Mistral v0.1: each token sees 4096
    back at most), which this file does not follow."""
    window = getattr(config, "sliding_window", None)
    require(
        window is None or length <= window,
        f"{what}: {length} tokens exceed the model's sliding_window of {window}, which this file "
        f"does not follow",
    )


# -----------------------------------------------------------------------------
# 9. Faster NF4: a vectorized bf16 dequantize; copy_ and pinned memory
# -----------------------------------------------------------------------------
# Needs: import sys, torch; from above: sections 2-3.
#
# Section 2's compiled dequantize looks each code up in the codebook, which Inductor makes a
# gather, and interleaves the two nibbles, which it makes scalar stores. For bf16 output
# this kernel gives the same bits in a form it vectorizes:
#   1. The lookup is a tree of selects between constants.
#   2. Each byte's two bf16 results, rounded on their bits, are packed into one int32 (the
#      first in the low half, as little-endian memory orders them), written contiguously,
#      and viewed as bf16 afterwards.


def _nf4_lookup(code):
    """NF4_VALUES[code] for an integer tensor of codes 0..15, without indexing: bit 0 of the
    code picks within each pair of values, bit 1 within pairs of pairs, and so on."""
    values = NF4_VALUES
    for bit in range(4):
        take_upper = (code & (1 << bit)) != 0
        pairs = zip(values[0::2], values[1::2])
        values = [torch.where(take_upper, hi, lo) for lo, hi in pairs]
    return values[0]


def _bf16_bits(x):
    """fp32 x -> the 16 bits of x.to(torch.bfloat16), in an int32 (round to nearest even)."""
    bits = x.view(torch.int32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _dequantize_bf16_pairs(
    packed, scale_q, scale_factor, scale_mean, block_size: int, scaler_block_size: int
):
    """(numel/2,) int32, each the two bf16 values of one packed byte: viewed as bf16, it
    equals _dequantize's output."""
    absmax = _dequantize_scales(scale_q, scale_factor, scale_mean, scaler_block_size)[:, None]
    byte = packed.view(-1, block_size // 2).int()  # (n_blocks, 32)
    first = _bf16_bits(_nf4_lookup(byte >> 4) * absmax)  # elements 0, 2, 4, ... of each block
    second = _bf16_bits(_nf4_lookup(byte & 0xF) * absmax)  # elements 1, 3, 5, ...
    return (first | (second << 16)).view(-1)


_dequantize_bf16_pairs_compiled = compile_dynamic(_dequantize_bf16_pairs)


# Traced into a bigger compiled graph (a compiled block), the kernel above loses its
# vectorization to the int32 -> bf16 view. As a custom op it stays one opaque call there,
# and that call runs the separately compiled kernel.
@torch.library.custom_op(f"{OPS}::dequantize_nf4_bf16", mutates_args=())
def _dequantize_bf16(
    inner: list[torch.Tensor], block_size: int, scaler_block_size: int
) -> torch.Tensor:
    """inner: packed, scale_q, scale_factor, scale_mean -> the weight, flat, in bf16."""
    pairs = _dequantize_bf16_pairs_compiled(*inner, block_size, scaler_block_size)
    return pairs.view(torch.bfloat16)


@_dequantize_bf16.register_fake
def _(inner, block_size, scaler_block_size):
    packed = inner[0]
    return packed.new_empty(2 * packed.numel(), dtype=torch.bfloat16)


def _dequantize_bf16_kernel(inner, block_size, scaler_block_size, dtype):
    return _dequantize_bf16(inner, block_size, scaler_block_size)


if sys.byteorder == "little":  # the pairs' layout above
    DEQUANTIZE_KERNELS[torch.bfloat16] = _dequantize_bf16_kernel


def _nf4_copy_(dst, src, non_blocking=False):
    """dst.copy_(src), an NF4Tensor on either side, nothing written before all is known: the
    codes copied from the same layout, re-quantized from another (as torchao does), quantized
    from a dense tensor; into a dense tensor, dequantized."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(
            f"copy_ into a tensor of shape {tuple(dst.shape)} from shape {tuple(src.shape)}"
        )
    if not isinstance(dst, NF4Tensor):
        return dst.copy_(src.dequantize(dst.dtype), non_blocking=non_blocking)
    layout = (dst.block_size, dst.scaler_block_size)
    if not isinstance(src, NF4Tensor):
        src = to_nf4(src.to(dst.dtype), *layout)
    elif (src.block_size, src.scaler_block_size) != layout:
        src = to_nf4(src.dequantize(torch.float32).to(dst.dtype), *layout)
    for name in NF4Tensor.INNER:
        getattr(dst, name).copy_(getattr(src, name), non_blocking=non_blocking)
    return dst


NF4_OPS.update(
    {
        aten.copy_.default: _nf4_copy_,
        aten._pin_memory.default: lambda t, *_: t._with_inner(torch.Tensor.pin_memory),
        aten.is_pinned.default: lambda t, *_: all(x.is_pinned() for x in t.inner()),
    }
)


# -----------------------------------------------------------------------------
# 10. Any model: FSDP for any module tree, AdamW as torch's drop-in
# -----------------------------------------------------------------------------
# Needs: import contextlib, math, torch, torch.distributed as dist; from above: section 5,
# section 6.
#
# Section 5's unit life already serves any module tree (pytrees in and out, modules called in
# any order, twice or not at all, a root unit). FSDP adds what a model of your own and the
# command line ask of it, as FSDP2's fully_shard has it:
#   - a device by default (the current GPU, else the CPU), its buffers moved there;
#   - reading a sharded parameter outside its unit is a clear error, not a crash;
#   - hybrid sharding (HSDP: a mean over the replicas after the reduce-scatter), and
#     cast_forward_inputs=False to leave the root's inputs as they are;
#   - the state in full, for checkpoints: the adapters (or their AdamW moments), the frozen
#     base one unit at a time, and a full tensor loaded into this rank's pieces.
# AdamW takes torch.optim.AdamW's keywords, state_dicts and closure.


class _Sharded:
    """Mixed into the class of a module holding sharded parameters."""

    def __getattr__(self, name):
        # A sharded parameter read outside its unit is a clear error, not a crash.
        fqn = self.__dict__.get("_fsdp_sharded", {}).get(name)
        if fqn is None:
            return super().__getattr__(name)
        raise AttributeError(
            f"{fqn} is sharded by FSDP and exists only while its unit runs (forward, backward); "
            f"FSDP.full_base() and full_adapters() gather it"
        )

    def extra_repr(self):
        # The module's own, unless it reads a sharded parameter (nn.Linear's reads its bias).
        with contextlib.suppress(AttributeError):
            return super().extra_repr()
        return "sharded by FSDP"


_SHARDED_CLASSES = {}  # a module's class -> the same class with _Sharded mixed in


def _mark_sharded(module, attr, fqn):
    """Note that module.attr is sharded; the module's class gains _Sharded (once per class)."""
    if "_fsdp_sharded" not in module.__dict__:
        cls = type(module)
        if cls not in _SHARDED_CLASSES:
            _SHARDED_CLASSES[cls] = type(cls.__name__, (_Sharded, cls), {})
        module.__class__ = _SHARDED_CLASSES[cls]
        module._fsdp_sharded = {}
    module._fsdp_sharded[attr] = fqn


def _mesh_groups(mesh):
    """(shard group, replicate group) of a pair, or of a DeviceMesh (replicate, shard)."""
    if isinstance(mesh, (tuple, list)):
        return mesh[0], mesh[1]
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    return mesh.get_group(1), mesh.get_group(0)


class FSDP(FullyShard):
    """Shards `model` as FSDP2's fully_shard does, in plain tensors: section 5's FullyShard for
    any model (the list above; the README has the rest). units: in forward's order, modules or
    lists of modules gathered together; every other parameter forms the root unit. device: the
    current GPU, else the CPU. group: the ranks to shard over (all). mesh: hybrid sharding
    (HSDP), a 2-D DeviceMesh (replicate, shard) as fully_shard takes, or a pair (shard group,
    replicate group): each group of ranks shards the model, and the groups replicate it, so
    that only the adapters' reduced gradient pieces cross between groups (an all-reduce).

        fsdp = FSDP(model, units=list(model), device="cuda", compute_dtype=torch.bfloat16)
        optimizer = AdamW(model.parameters(), lr=1e-4)  # the pieces: make it after FSDP
        loss_fn(model(x), y).backward()  # under torchrun: dist.init_process_group() first
        fsdp.clip_grad_norm_(1.0)  # over all ranks (torch's would see this rank's pieces)
        optimizer.step()
        adapters = fsdp.full_adapters()  # {name: full fp32 tensor}, on every rank

    For checkpoints (collectives): full_adapters(of=...), e.g.
    of=lambda m: optimizer.state[m]["exp_avg"], full_base(), load_full().
    """

    def __init__(
        self,
        model,
        units,
        device=None,
        compute_dtype=None,
        offload=False,
        group=None,
        cast_forward_inputs=True,
        mesh=None,
    ):
        replicate_group = None
        if mesh is not None:
            group, replicate_group = _mesh_groups(mesh)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device == torch.device("cuda"):
            device = torch.device("cuda", torch.cuda.current_device())
        self.replicate_group = replicate_group  # HSDP: the ranks that hold the same pieces
        self.cast_forward_inputs = cast_forward_inputs
        super().__init__(model, units, device, compute_dtype, offload, group)
        self.param_of = {p.fqn: (u, p) for u in self.all_units for p in u.params}
        # Buffers are not sharded: they move to the device, as FSDP2 moves them (one on "meta"
        # is made there, for its module to fill as its weights load).
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None and buffer.is_meta:
                    module._buffers[key] = torch.empty_like(buffer, device=device)
                elif buffer is not None:
                    module._buffers[key] = buffer.to(device)
        for fqn, (_, p) in self.param_of.items():
            for module, attr in p.places:
                _mark_sharded(module, attr, fqn)

    def cast_inputs(self, args, kwargs):
        """FullyShard's, unless cast_forward_inputs is False."""
        if not self.cast_forward_inputs:
            return args, kwargs
        return super().cast_inputs(args, kwargs)

    def reduced(self, grad):
        """FullyShard's mean over the shard group; with HSDP then the mean over the replicas,
        an all-reduce of the adapters' gradient pieces: all that crosses between groups."""
        grad = super().reduced(grad)
        replicas = self.replicate_group
        if replicas is not None:
            with torch.profiler.record_function("fsdp::all_reduce"):
                op = dist.ReduceOp.AVG if _averages(replicas) else dist.ReduceOp.SUM
                dist.all_reduce(grad, op=op, group=replicas)
                if not _averages(replicas):
                    grad.div_(dist.get_world_size(replicas))
        return grad

    # The state in full, for checkpoints. These are collectives: every rank gets (or gives)
    # all of it.
    def full_adapters(self, of=None):
        """{name: full fp32 tensor, on the host} of every trainable parameter, or of of(its
        piece) (its gradient, an AdamW moment)."""
        of = of or (lambda piece: piece)  # the pieces themselves: together, the master
        full = {}
        for unit in self.trained:
            flat = torch.cat([of(slot.local).reshape(-1) for slot in unit.adapters])
            send = flat.detach().to(self.device, torch.float32)
            out = torch.empty(self.world * flat.numel(), dtype=torch.float32, device=self.device)
            work = _collective(out, send, self.group)
            if work is not None:
                work.wait()
            rows = out.view(self.world, -1)  # (world, master numel): a tensor's pieces in columns
            for slot in unit.adapters:
                columns = rows[:, slot.start : slot.start + slot.shard_numel]
                whole = columns.reshape(-1)[: slot.numel].view(slot.shape)
                full[slot.name] = whole.cpu()
        return full

    def load_full(self, fqn, tensor, of=None):
        """Keep this rank's piece of one full parameter (an NF4 weight as an NF4Tensor), in its
        parameter or in of(its piece) (an AdamW moment)."""
        p = self.param_of[fqn][1]
        if of is None:
            p.keep(tensor)
            return
        of(p.slots[0].local).copy_(p.slots[0].piece(tensor))

    def full_base(self):
        """(name, full tensor) of every frozen parameter, one unit gathered at a time (freed with
        its unit: clone it to keep it)."""
        for unit in self.all_units:
            frozen = [p for p in unit.params if not p.trainable]
            if not frozen:
                continue
            unit.gather()
            for p in frozen:
                yield p.fqn, p.value
            unit.free()

    def adapter_shapes(self):
        return {slot.name: slot.shape for unit in self.all_units for slot in unit.adapters}

    def local_bytes(self):
        """Bytes this rank keeps between steps: its shard bytes and fp32 masters."""
        masters = sum(unit.master.nbytes for unit in self.trained)
        return masters + sum(unit.shard_bytes.nbytes for unit in self.all_units)


# torch.optim.AdamW's other keywords at their defaults: what AdamW implements. (foreach may
# also be True.)
TORCH_ADAMW = dict(
    amsgrad=False,
    maximize=False,
    foreach=None,
    capturable=False,
    differentiable=False,
    fused=None,
    decoupled_weight_decay=True,
)
# On the CPU, AdamW's passes over p, g, m and v take a cache-sized chunk of parameters at a
# time, so that later passes find them in cache; on a GPU all form one chunk, one kernel
# launch per pass.
ADAM_CHUNK_BYTES = {"cpu": 1 << 20}  # bytes of parameters per chunk; a device absent: one


class AdamW(ForeachAdamW):
    """Section 6's AdamW as a drop-in for torch.optim.AdamW: torch's keywords at their
    defaults (TORCH_ADAMW; others refused by name), a closure, a tensor lr, torch's
    state_dicts both ways; no sparse or complex support."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **kw):
        unknown = sorted(set(kw) - set(TORCH_ADAMW))
        if unknown:
            raise TypeError(f"AdamW got an unexpected keyword argument {unknown[0]!r}")
        self._torch_keywords = {**TORCH_ADAMW, **kw}  # read by add_param_group, in __init__
        super().__init__(params, lr, betas, eps, weight_decay)
        self.defaults.update(self._torch_keywords)

    def add_param_group(self, group):
        super().add_param_group(group)
        self._check(self.param_groups[-1])

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            self._check(group)

    def _check(self, group):
        """Refuse what is not implemented, in each group as it is added or loaded. A keyword a
        group lacks takes its value from the defaults."""
        for key, default in TORCH_ADAMW.items():
            value = group.setdefault(key, self._torch_keywords[key])
            allowed = value == default
            allowed |= key == "foreach" and bool(value)
            allowed |= key == "fused" and value is False
            if not allowed:
                raise ValueError(
                    f"AdamW: {key}={value!r} is not implemented here (torch.optim.AdamW has it)"
                )

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient. closure: as torch.optim's."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse or p.is_complex() for p in params):
                raise RuntimeError("AdamW does not support sparse gradients or complex parameters")
        super().step()
        return loss

    def _chunks(self, params):
        """Runs of about ADAM_CHUNK_BYTES of params that share their step count."""
        chunks = []
        nbytes = math.inf
        step = None
        for p in params:
            chunk_bytes = ADAM_CHUNK_BYTES.get(p.device.type, math.inf)
            if nbytes >= chunk_bytes or self.state[p]["step"] != step:
                chunks.append([])
                nbytes = 0
                step = self.state[p]["step"]
            chunks[-1].append(p)
            nbytes += p.nbytes
        return chunks


# -----------------------------------------------------------------------------
# 11. The Llama family, packed documents, DoRA, generation with a KV cache
# -----------------------------------------------------------------------------
# Needs: import dataclasses, math, torch, torch.distributed as dist, torch.nn as nn,
# torch.nn.functional as F; from dataclasses import dataclass; from typing import Optional;
# from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention;
# from above: sections 1-8.
#
# The family people fine-tune is Llama with a few deltas, as transformers' modular files
# write them (modular_qwen2.py is essentially Qwen2Attention(LlamaAttention) with biases):
# Mistral sets head_dim and may set sliding_window; Qwen2 gives q, k and v a bias; Qwen3
# sets head_dim and RMS-normalizes each head of q and k before RoPE; Llama 3.1 scales RoPE's
# long wavelengths.
#
# Attention reads its `mask` argument by kind: None is causal, a (B, 1, T, T) bool is SDPA's
# mask, a BlockMask (packed rows on CUDA) runs flex_attention, and a mask with an `attend`
# method is handed q, k and v: a KVCache (generation) attends over the keys and values it
# holds, section 12's ContextParallel over the whole row. Packed rows reach it from their
# positions alone.


@dataclass
class FamilyConfig(LlamaConfig):
    """LlamaConfig with the family's deltas (the field names are config.json's)."""

    rope_scaling: Optional[dict] = None  # Llama 3.1: {"rope_type": "llama3", "factor": 8.0, ...}
    tie_word_embeddings: bool = False
    model_type: str = "llama"  # or "mistral", "qwen2", "qwen3"
    attention_bias: bool = False  # a bias on q, k, v and o (Llama's, Qwen3's option)
    mlp_bias: bool = False  # a bias on gate, up and down (Llama's option)
    sliding_window: Optional[int] = None  # Mistral: attend to this many tokens back at most

    def rope_inv_freq(self):
        """LlamaConfig's, with Llama 3.1's frequency-dependent scaling if configured."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) != "llama3":
            return super().rope_inv_freq()
        d = self.head_dim
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        # Long wavelengths are slowed down by `factor`, short ones kept, and the band
        # between them blended smoothly.
        factor = scaling["factor"]
        low = scaling.get("low_freq_factor", 1.0)
        high = scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(mid, blended, scaled).float()


def as_family(config):
    """config as a FamilyConfig (a plain LlamaConfig is the family's Llama)."""
    if isinstance(config, FamilyConfig):
        return config
    return FamilyConfig(**dataclasses.asdict(config))


def shared_input(x, *layers):
    """[m(x) for m in layers] for LoRALinears that read the same x (q, k, v; gate, up), with
    one x [A_1; A_2]^T matmul for all: one pass over x, here and for the gradients. (With
    dropout, a mask per layer: each layer runs alone.)"""
    if any(not isinstance(m.dropout, nn.Identity) for m in layers):
        return [m(x) for m in layers]
    A = torch.cat([m.lora_A for m in layers]).to(x.dtype)
    xA = F.linear(x, A)  # (..., sum of the ranks)
    parts = xA.split([m.rank for m in layers], dim=-1)
    return [m(x, part) for m, part in zip(layers, parts)]


# DoRA (Liu et al. 2024) splits each adapted weight into a direction and a magnitude: W' = m V /
# ||V||, row by row, V = W + s B A, with a trainable magnitude m (out,) that starts at ||W||; B =
# 0, so the layer starts as W. The norm is detached (the paper's section 4.3), as PEFT has it:
#   y = (m / n) * (x W^T + s x A^T B^T) + bias,   n = ||W + s B A|| per row.
# PEFT, with dropout d in training, applies the magnitude's change to the dropped input:
#   y = x W^T + (m / n - 1) * d(x) W^T + (m / n) * s d(x) A^T B^T + bias.
# n needs no dense W + s B A, nor a second dequantize of W: row by row,
#   ||W_i + s (B A)_i||^2 = ||W_i||^2 + 2 s B_i . (W A^T)_i + s^2 B_i (A A^T) B_i^T.
# W is frozen, so ||W_i||^2 is taken once, when W is set; A W^T (rank, out) comes from the one
# dequantize that gives x W^T. What a step adds is (out x rank) work and the scale by m / n.


def squared_row_norms(weight, compile=None):
    """||W_i||^2 (out,), fp32, of an NF4 weight dequantized in its dtype, as a forward sees it
    (summed a few rows at a time: no fp32 copy of W)."""
    w = weight.dequantize(compile=compile).view(weight.shape[0], -1)  # (out, in)
    rows = max(1, DEQUANT_CHUNK // w.shape[1])
    return torch.cat([part.float().square().sum(dim=1) for part in w.split(rows)])


@torch.library.custom_op(f"{OPS}::dora_nf4", mutates_args=())
def _dora_nf4(
    x: torch.Tensor,
    A: torch.Tensor,
    inner: list[torch.Tensor],
    sizes: list[int],
    compile: Optional[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """x W^T (..., out) and A W^T (rank, out) from one dequantize of W (out, in). sizes: out,
    the block sizes."""
    out_features, block_size, scaler_block_size = sizes
    w = dequantize_nf4(*inner, block_size, scaler_block_size, x.dtype, compile)
    w = w.view(out_features, -1)  # (out, in)
    return x @ w.T, A @ w.T


@_dora_nf4.register_fake
def _(x, A, inner, sizes, compile):
    out_features = sizes[0]
    return x.new_empty(*x.shape[:-1], out_features), A.new_empty(A.shape[0], out_features)


def _dora_nf4_setup(ctx, inputs, output):
    x, A, inner, sizes, compile = inputs
    _matmul_nf4_setup(ctx, (x, inner, sizes, True, compile), output)


def _dora_nf4_backward(ctx, grad_y, grad_AW):
    """x's gradient only, grad_y W, as linear_nf4's: A W^T is a constant here (n is detached)."""
    grad_x = _matmul_nf4_backward(ctx, grad_y)[0]
    return grad_x, None, [None] * 4, None, None


_dora_nf4.register_autograd(_dora_nf4_backward, setup_context=_dora_nf4_setup)


def dora_scale(magnitude, lora_A, lora_B, scaling, AW, weight_norm_sq):
    """m / n (out,), n = ||W + s B A|| per row (detached) from ||W_i||^2, A W^T (AW, (rank,
    out)) and A A^T."""
    with torch.no_grad():
        B = lora_B.float()  # (out, rank)
        A = lora_A.float()  # (rank, in)
        cross = (B * AW.float().T).sum(dim=1)  # B_i . (W A^T)_i
        quadratic = ((B @ (A @ A.T)) * B).sum(dim=1)  # B_i (A A^T) B_i^T
        n_sq = weight_norm_sq + 2 * scaling * cross + scaling**2 * quadratic
        n = n_sq.clamp_min(0).sqrt()
    return magnitude / n


def dora_merge(v, magnitude):
    """DoRA's merged weight from V = W + s B A (out, in): (m / ||V_i||) V_i, row by row."""
    return (magnitude.to(v.dtype) / v.norm(dim=1))[:, None] * v


class DoRALinear(LoRALinear):
    """QDoRA's layer: LoRALinear's (the same arguments, and from_linear) plus a trainable fp32
    magnitude, lora_magnitude_vector (out,), that starts at W's row norms (PEFT's use_dora).
    weight_norm_sq, ||W_i||^2, is a buffer outside state_dict, taken whenever W is set: built,
    loaded by load_state_dict, or by section 14's load_weights (sharded or not)."""

    def __init__(self, in_features, out_features, rank=8, alpha=16.0, dropout=0.0, **kw):
        super().__init__(in_features, out_features, rank, alpha, dropout, **kw)
        self.from_lora(self)  # the LoRALinear just built, given its magnitude

    @classmethod
    def from_lora(cls, layer):
        """A LoRALinear made a DoRALinear in place (as fully_shard swaps a module's class): its
        tensors kept, nothing quantized again, its magnitude added."""
        layer.__class__ = cls
        layer.register_buffer("weight_norm_sq", None, persistent=False)
        layer.weight_loaded(layer.weight)
        layer.lora_magnitude_vector = nn.Parameter(layer.weight_norm_sq.sqrt())
        return layer

    def weight_loaded(self, weight):
        """W (an NF4Tensor) was set, here or by section 14's load_weights: its row norms follow."""
        self.weight_norm_sq = squared_row_norms(weight, self.compile_kernels)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "weight" in state_dict:  # a new W
            self.weight_loaded(self.weight)

    def forward(self, x, xA=None):
        """x (..., in) -> (..., out). xA: dropout(x) A^T, if the caller made it already."""
        dropout = self.training and isinstance(self.dropout, nn.Dropout)
        dropped = self.dropout(x) if dropout else x
        if xA is None:
            xA = F.linear(dropped, self.lora_A.to(x.dtype))  # (..., rank)
        A = self.lora_A.detach().to(x.dtype)
        sizes = [self.out_features, self.weight.block_size, self.weight.scaler_block_size]
        both = torch.stack([x, dropped]) if dropout else x  # (2, ..., in): one dequantize
        y, AW = _dora_nf4(both, A, self.weight.inner(), sizes, self.compile_kernels)
        m = self.lora_magnitude_vector
        scale = dora_scale(m, self.lora_A, self.lora_B, self.scaling, AW, self.weight_norm_sq)
        scale = scale.to(x.dtype)
        B = self.lora_B.to(x.dtype)
        if dropout:
            lora = self.scaling * F.linear(xA, B)  # (..., out)
            y = y[0] + (scale - 1) * y[1] + scale * lora
        else:  # (m / n) (x W^T + s xA B^T), the sum as LoRA's one addmm
            y2d = y.view(-1, y.shape[-1])
            xA2d = xA.view(-1, self.rank)
            y = scale * torch.addmm(y2d, xA2d, B.T, alpha=self.scaling).view(y.shape)
        return y if self.bias is None else y + self.bias

    def merged_weight(self, dtype=torch.float32):
        """(m / n) (W + s B A), n its row norms, dense: PEFT's merge."""
        v = super().merged_weight(torch.float32)
        return dora_merge(v, self.lora_magnitude_vector.detach().float()).to(dtype)


def dora_magnitudes(model):
    """{name of each DoRA magnitude: W's row norms, where it starts}."""
    found = {}
    for name, m in model.named_modules():
        if isinstance(m, DoRALinear):
            found[f"{name}.lora_magnitude_vector"] = m.weight_norm_sq.sqrt()
    return found


def _add_bias(dtype, *layers):
    """A frozen zero bias on each of the layers, which have none (a checkpoint's comes later)."""
    for linear in layers:
        zeros = torch.zeros(linear.out_features, dtype=dtype)
        linear.bias = nn.Parameter(zeros, requires_grad=False)


class FamilyAttention(LlamaAttention):
    """LlamaAttention with the family's biases, Qwen3's q_norm and k_norm, and the masks above
    (a BlockMask, a mask that attends); q, k and v share x A^T."""

    def __init__(self, c, lora):
        super().__init__(c, lora)
        dtype = lora["dtype"]
        if c.attention_bias or c.model_type == "qwen2":  # Qwen2's q, k and v have one
            _add_bias(dtype, self.q_proj, self.k_proj, self.v_proj)
        if c.attention_bias:
            _add_bias(dtype, self.o_proj)
        self.qk_norm = c.model_type == "qwen3"
        if self.qk_norm:  # Qwen3: q_norm and k_norm over each head
            self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps, dtype)

    def project(self, x):
        B, T, C = x.shape
        q, k, v = shared_input(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv, self.head_dim)
        v = v.view(B, T, self.n_kv, self.head_dim)
        if self.qk_norm:  # each head normalized over its head_dim, before RoPE
            q = self.q_norm(q)
            k = self.k_norm(k)
        return q, k, v

    def attend(self, q, k, v, mask):
        if isinstance(mask, BlockMask):
            gqa = self.n_kv != self.n_heads
            return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
        return super().attend(q, k, v, mask)


def _attend(self, q, k, v, mask, sdpa=LlamaAttention.attend):
    """Part I's attend, handing q, k and v to a mask that attends (a KVCache, section 12's
    ContextParallel): registered on LlamaAttention, so that Part I's Llama generates too."""
    if hasattr(mask, "attend"):
        return mask.attend(self, q, k, v)
    return sdpa(self, q, k, v, mask)


LlamaAttention.attend = _attend


class FamilyMLP(LlamaMLP):
    """LlamaMLP with Llama's optional biases (mlp_bias), gate and up sharing x A^T."""

    def __init__(self, c, lora):
        super().__init__(c, lora)
        if c.mlp_bias:
            _add_bias(lora["dtype"], self.gate_proj, self.up_proj, self.down_proj)

    def forward(self, x):
        gate, up = shared_input(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


class FamilyDecoderLayer(LlamaDecoderLayer):
    Attention = FamilyAttention
    MLP = FamilyMLP


def document_mask(positions):
    """Rows packed with whole documents, from their positions (B, T): a document starts at each
    0, as transformers reads packed position_ids. -> where each token may attend, only to the
    earlier tokens of its own document: a (B, 1, T, T) bool on the CPU; on CUDA flex_attention's
    BlockMask, O((T / 128)^2) per row, never T x T."""
    B, T = positions.shape
    documents = (positions == 0).cumsum(dim=1)  # (B, T): a document id per token
    if positions.is_cuda:  # a fused kernel that skips the blocks no document reaches

        def same_document_causal(b, h, q, kv):
            return (documents[b, q] == documents[b, kv]) & (q >= kv)

        return create_block_mask(same_document_causal, B, None, T, T, device=positions.device)
    index = torch.arange(T, device=positions.device)
    same = documents[:, :, None] == documents[:, None, :]  # (B, T, T)
    causal = index[:, None] >= index[None, :]
    return (same & causal)[:, None]


class CausalLM(Llama):
    """Llama and its family (Mistral, Qwen2, Qwen3) as transformers' <Family>ForCausalLM.
    nf4_head: the lm_head in NF4. dora: DoRALinear on every projection. offload_activations:
    section 13's OffloadedInputs, or None. context_parallel: section 12's ContextParallel, or
    None."""

    Block = FamilyDecoderLayer

    def __init__(self, config, *args, nf4_head=False, dora=False, **kwargs):
        """config: a LlamaConfig or FamilyConfig; the other arguments are Llama's."""
        super().__init__(as_family(config), *args, **kwargs)
        if dora:
            for layer in [m for m in self.modules() if isinstance(m, LoRALinear)]:
                DoRALinear.from_lora(layer)
        self.offload_activations = None
        self.context_parallel = None
        if nf4_head:
            weight = to_nf4(self.lm_head.weight.detach(), compile=self.lm_head.compile_kernels)
            self.lm_head.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, tokens, targets=None, reduction="mean", positions=None, mask=None):
        """Llama's. positions (B, T) that start again at 0: packed rows, each document as if
        alone (document_mask). mask: a KVCache holds the positions before these. Under
        context_parallel (and no cache) the rows are this rank's pieces."""
        split = self.context_parallel if mask is None else None
        T = tokens.shape[1] * (split.pieces() if split else 1)  # the whole row's
        if mask is None:  # generate checks the cache's whole length itself
            check_window(self.config, T, "sequences")
        if self.offload_activations is not None:
            self.offload_activations.start(None)  # a new forward: a new chain of inputs
        if split is not None:
            positions, mask = split.rows(positions, tokens.shape[1], tokens.device)
        elif mask is None and positions is not None and positions.dim() == 2:
            mask = document_mask(positions)
        return super().forward(tokens, targets, reduction, positions, mask)


# What sets a family apart is written once, in its modules above: its parameters, their
# counts and a checkpoint's shapes are read off the model built on "meta" with one block.


_TENSORS = {}  # (repr(config), lora_rank, nf4_head, dora) -> model_tensors'


def model_tensors(config, lora_rank=8, nf4_head=False, dora=False):
    """{name: (shape, kind)} of the parameters of a CausalLM of this config with one block,
    "model.layers.0." (built once per config, on "meta"). kind: "nf4" (frozen, 4-bit), "head"
    (the dense lm_head), "dense" (other frozen ones) or "adapter" (trained)."""
    key = (repr(config), lora_rank, nf4_head, dora)
    if key in _TENSORS:
        return _TENSORS[key]
    one = dataclasses.replace(config, num_hidden_layers=1)
    with torch.device("meta"):
        model = CausalLM(one, lora_rank=lora_rank, nf4_head=nf4_head, dora=dora)
    found = _TENSORS[key] = {}
    for name, p in model.named_parameters():
        kind = "adapter" if p.requires_grad else "dense"
        if isinstance(p, NF4Tensor):
            kind = "nf4"
        elif name == "lm_head.weight":
            kind = "head"
        found[name] = (tuple(p.shape), kind)
    return found


def count_family_params(config, lora_rank=8, nf4_head=False, dora=False):
    """count_params for any family (its biases, Qwen3's q_norm and k_norm; an NF4 head counted
    with the NF4 projections, DoRA's magnitudes with the adapters)."""
    n = dict(nf4=0, head=0, dense=0, adapter=0)
    for name, (shape, kind) in model_tensors(config, lora_rank, nf4_head, dora).items():
        in_block = name.startswith("model.layers.0.")
        times = config.num_hidden_layers if in_block else 1
        n[kind] += times * math.prod(shape)
    return ParamCounts(n["nf4"], n["head"], n["dense"], n["adapter"])


def hf_shapes(config, layer=None):
    """{name: shape} of a Hugging Face checkpoint's tensors: block `layer`'s, or with none the
    others (the embeddings, the final norm, lm_head)."""
    shapes = {}
    for name, (shape, kind) in model_tensors(config).items():
        in_block = name.startswith("model.layers.0.")
        if in_block == (layer is not None) and kind != "adapter":
            shapes[name.replace("model.layers.0.", f"model.layers.{layer}.")] = shape
    return shapes


def adapter_shapes(config, lora_rank=8, dora=False):
    """{name: shape} of the trained tensors of a CausalLM of this config, in every block: what a
    run's adapters, --resume's and --adapter's must be."""
    shapes = {}
    for i in range(config.num_hidden_layers):
        for name, (shape, kind) in model_tensors(config, lora_rank, dora=dora).items():
            if kind == "adapter":
                shapes[name.replace("model.layers.0.", f"model.layers.{i}.")] = shape
    return shapes


class KVCache:
    """The keys and values of a model's attentions, up to `length` positions: model(ids,
    positions=..., mask=cache) runs ids (B, T), the tokens after the `filled` cached ones, at
    those positions, and caches theirs (the caller then counts them in `filled`). A new token
    needs only the last position's logits, and the keys and values of the positions before it
    never change: the prompt is one forward and each new token one more, over that token alone
    (not the whole sequence again)."""

    def __init__(self, length):
        self.length = length
        self.filled = 0  # positions cached so far
        self.keys = {}  # attention -> (B, n_kv, length, head_dim)
        self.values = {}

    def attend(self, attention, q, k, v):
        """q (B, nh, T, hd), k and v (B, nkv, T, hd) of the T new positions -> attention over
        every position so far (B, nh, T, hd), each query seeing keys up to its own position."""
        start = self.filled
        end = start + q.shape[2]
        if attention not in self.keys:
            shape = (*k.shape[:2], self.length, k.shape[3])
            self.keys[attention] = k.new_empty(shape)
            self.values[attention] = v.new_empty(shape)
        keys = self.keys[attention][:, :, :end]
        values = self.values[attention][:, :, :end]
        keys[:, :, start:] = k
        values[:, :, start:] = v
        position = torch.arange(start, end, device=q.device)[:, None]
        visible = torch.arange(end, device=q.device) <= position  # (T, end)
        return attention.attend(q, keys, values, visible)  # as a (T, end) mask


def next_token(logits, temperature, generator):
    """The argmax of logits (vocab,) at temperature 0, else a draw from softmax(logits / T)
    by `generator` (on the CPU, so that every device draws alike): (1,) on logits' device."""
    if temperature == 0:
        return logits.argmax().view(1)
    # In float64, shifted by the max: no overflow down to T = 1e-300.
    scaled = (logits - logits.max()).double() / max(temperature, 1e-300)
    probs = torch.softmax(scaled, -1).cpu()
    return torch.multinomial(probs, 1, generator=generator).to(logits.device)


def model_device(model):
    """Where model computes: the device of a tensor it holds off the host, else the CPU. A
    sharded model holds pieces of its weights, and its buffers, on the device; with --cpu_offload
    what it holds between steps is on the host: pass generate a device then."""
    held = [*model.parameters(), *model.buffers()]
    return next((t.device for t in held if t.device.type != "cpu"), torch.device("cpu"))


@torch.no_grad()
def generate(
    model, ids, max_new_tokens, temperature=0.0, stop=(), seed=0, cache=True, device=None, each=None
):
    """New token ids after `ids` (a list, or (1, T)), at most max_new_tokens, ending at the
    first id in `stop` (returned last): greedy at temperature 0, else drawn from softmax(logits
    / T), seeded by `seed`. With the KV cache the prompt is one forward and each new token one
    more; cache=False reruns the whole sequence for each (the reference). Under FSDP every rank
    calls it and rank 0's tokens are every rank's. device: where ids go (None: model_device's).
    each(ids so far): called as each token comes (to stream the reply). The model runs in eval
    mode (no dropout), and is then put back in the mode it was in."""
    ids = torch.as_tensor(ids, device=device or model_device(model)).view(1, -1)
    length = ids.shape[1] + max_new_tokens
    check_window(model.config, length, "a prompt and its new tokens")
    generator = seeded(seed, "sample")
    training = model.training
    # Every rank holds the whole sequence, not a piece of it (section 12): no split.
    split = getattr(model, "context_parallel", None)
    # Each module runs its class's forward: a compiled one set on the instance (build's
    # blocks) would compile again for every new length. (The NF4 kernels stay compiled: one
    # graph serves every shape.)
    compiled = {m: vars(m).pop("forward") for m in model.modules() if "forward" in vars(m)}
    new = []
    try:
        model.eval()
        if split is not None:
            model.context_parallel = None
        kv = KVCache(length) if cache else None
        step = ids  # what the next forward reads: with the cache, the new token alone
        for _ in range(max_new_tokens):
            if kv is None:
                logits = model(ids)
            else:
                positions = torch.arange(kv.filled, kv.filled + step.shape[1], device=ids.device)
                logits = model(step, positions=positions, mask=kv)
                kv.filled += step.shape[1]
            token = next_token(logits[0, -1].float(), temperature, generator)
            if dist.is_initialized():
                dist.broadcast(token, src=0)
            new.append(token.item())
            if each is not None:
                each(new)
            if new[-1] in stop:
                break
            step = token.view(1, 1)
            ids = torch.cat([ids, step], dim=1)
    finally:  # the model as it was
        model.train(training)
        if split is not None:
            model.context_parallel = split
        for m, forward in compiled.items():
            m.forward = forward
    return new


# Part I's model generates too (as the API has it): registered here, as from_pretrained is.
Llama.generate = generate


# -----------------------------------------------------------------------------
# 12. Long context: each sequence split across the ranks (--context_parallel)
# -----------------------------------------------------------------------------
# Needs: import math, torch, torch.distributed as dist; from typing import NamedTuple; from
# above: section 8, section 11.
#
# Sharding divides the weights by the world, but a rank that runs whole sequences keeps their
# activations whole: two GPUs fit no longer a context than one. With --context_parallel N the N
# ranks of a group hold consecutive pieces of the same rows, T / N tokens each. Everything in
# a block but attention works token by token, so it runs on the piece as it is; attention
# needs every earlier token. Two schemes give it them:
# - a ring (Ring Attention) passes keys and values around the group, N - 1 hops, merging
#   partial softmaxes by their log-sum-exp: attention kernels of its own, and traffic of the
#   whole sequence's keys and values per rank, whatever N;
# - DeepSpeed-Ulysses trades the sequence split for a head split with an all-to-all, runs
#   ordinary attention over the whole sequence for nh / N heads, and trades back.
# This file takes Ulysses: SDPA and flex_attention run unchanged (document masks included,
# built for the whole row), and each rank moves 2 (N - 1) / N^2 of a layer's q, k, v and
# output, falling as N grows. Its limit: N divides the query heads (32 for Llama-3.1-8B).
#
# A model of your own takes it as section 11's CausalLM does: each forward calls cp.rows on
# its piece of T / N tokens (N divides T) and uses both results, the piece's positions in the
# whole row (for RoPE or a learned position embedding alike) and the mask for attention, whose
# attend(q, k, v, mask) (mask None: causal) hands q, k and v to a mask with an attend method.
# A weight's gradient is then the sum of the ranks' gradients of their loss sums, divided by
# the count of targets over all ranks: section 8's train_step scales each rank's loss so that
# FSDP's mean over the ranks is that sum; a model without FSDP sums it over the group with an
# all-reduce.


def _all_to_all(x, group):
    x = x.contiguous()  # the collective reads and writes memory in order
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """x (N, ...): chunk i goes to rank i of the group, and chunk j of the result came from
    rank j. As a matrix (sender, chunk) that is a transpose, its own inverse: backward sends
    the gradient back the same way."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group), None


def seq_to_heads(x, group):
    """x (B, H, T / N, hd), this rank's piece -> (B, H / N, T, hd): the whole sequence of heads
    [r H / N, (r + 1) H / N), r this rank's index in the group (piece j came from rank j)."""
    N = dist.get_world_size(group)
    B, H, Tn, hd = x.shape
    x = x.reshape(B, N, H // N, Tn, hd).transpose(0, 1)  # (N, B, H / N, T / N, hd)
    x = _AllToAll.apply(x, group)  # chunk j: piece j of the sequence
    return x.permute(1, 2, 0, 3, 4).reshape(B, H // N, N * Tn, hd)


def heads_to_seq(x, group):
    """seq_to_heads' inverse: x (B, H / N, T, hd) -> (B, H, T / N, hd), this rank's piece."""
    N = dist.get_world_size(group)
    B, Hn, T, hd = x.shape
    x = x.reshape(B, Hn, N, T // N, hd).permute(2, 0, 1, 3, 4)  # (N, B, H / N, T / N, hd)
    x = _AllToAll.apply(x, group)  # chunk j: heads [j H / N, (j + 1) H / N)
    return x.transpose(0, 1).reshape(B, N * Hn, T // N, hd)


class ContextParallel(NamedTuple):
    """--context_parallel's group, whose ranks hold the pieces of the same rows (a CausalLM's
    context_parallel); and as the mask attention takes, with the whole row's mask (None:
    causal; packed rows': document_mask's)."""

    group: object
    mask: object = None

    def pieces(self):
        return dist.get_world_size(self.group)

    def rows(self, positions, T, device):
        """(positions, mask) for this rank's piece of T tokens: its positions in the whole row,
        and this with the whole row's mask. positions: the piece's (B, T) of packed rows,
        gathered from the group to mask the whole row; None: 0, 1, ... over the whole row."""
        index = dist.get_rank(self.group)
        if positions is None:
            return torch.arange(index * T, (index + 1) * T, device=device), self
        pieces = [torch.empty_like(positions) for _ in range(self.pieces())]
        dist.all_gather(pieces, positions.contiguous(), group=self.group)
        whole = torch.cat(pieces, dim=1)  # (B, N T)
        return positions, ContextParallel(self.group, document_mask(whole))

    def attend(self, attention, q, k, v):
        """q (B, nh, T / N, hd), k and v (B, nkv, T / N, hd), this rank's piece, RoPE'd at the
        whole row's positions -> attention over the whole row, (B, nh, T / N, hd)."""
        N = self.pieces()
        # Rank r gets query heads [r nh / N, ...), which read kv heads [r nkv / N, ...) where
        # N divides nkv. Where it does not (grouped-query attention with few kv heads), each
        # kv head is repeated to lcm(nkv, N) heads, so that every rank receives the kv heads
        # its query heads read; copies stay together, and backward sums them.
        repeat = N // math.gcd(k.shape[1], N)
        if repeat > 1:
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        q, k, v = (seq_to_heads(t, self.group) for t in (q, k, v))
        y = attention.attend(q, k, v, self.mask)  # (B, nh / N, T, hd)
        return heads_to_seq(y, self.group)


def context_groups(n):
    """The ContextParallel of this rank's group of n consecutive ranks (every rank makes every
    group, in order), or None for n = 1."""
    if n == 1:
        return None
    world, rank = world_and_rank()
    groups = [dist.new_group(list(range(g, g + n))) for g in range(0, world, n)]
    return ContextParallel(groups[rank // n])


def piece_of(batch, n, index):
    """Piece `index` of n of each row of a Batch: tokens [index T / n, (index + 1) T / n);
    n divides T (check_context_parallel refuses a --seq_len it does not)."""
    return Batch(*(None if t is None else t.chunk(n, dim=1)[index] for t in batch))


def data_parallel(n, world, rank):
    """(world, rank) of the rows, n ranks splitting each: a context-parallel group shares them."""
    return world // n, rank // n


def check_context_parallel(n, seq_len, world, shard, config):
    """Refuse, in one line, a --context_parallel n that cannot split the rows of seq_len tokens,
    the world's ranks, the groups of `shard` ranks that shard the state, or the heads."""
    flag = f"--context_parallel {n}"
    require(seq_len % n == 0, f"{flag}: does not divide --seq_len {seq_len}")
    require(world % n == 0, f"{flag}: does not divide the {world} ranks")
    heads = config.num_attention_heads
    require(heads % n == 0, f"{flag}: does not divide the model's {heads} attention heads")
    require(
        shard % n == 0,
        f"{flag}: its groups must lie within the --shard_size {shard} groups (the all-to-alls "
        f"of every layer belong on a machine's fast links, as the all-gathers do)",
    )


# -----------------------------------------------------------------------------
# 13. Fitting in memory: parked activations, tiles, the predicted peak, --fit
# -----------------------------------------------------------------------------
# Needs: import dataclasses, functools, math, os, re, torch, torch.distributed as dist; from
# dataclasses import dataclass; from typing import NamedTuple; from torch.utils.checkpoint
# import checkpoint; from above: GiB, section 1, section 5, section 7, section 8, section 10,
# section 11.
#


def fmt_bytes(n):
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_budget(name, budget):
    """Section 1's memory_budget, as a table."""
    n_params = budget.n_params / 1e6
    n_lora = budget.n_lora / 1e6
    rows = [
        f"memory before activations, {name} "
        f"({n_params:,.1f} M params, {n_lora:,.2f} M LoRA params):"
    ]
    for label, b in (("full fine-tune, bf16", budget.full_bf16), ("QLoRA, NF4 base", budget.qlora)):
        rows.append(
            f"  {label:<21} params {fmt_bytes(b.params):>9} + grads {fmt_bytes(b.grads):>9}"
            f" + Adam {fmt_bytes(b.optimizer):>9} = {fmt_bytes(b.total()):>9}"
        )
    return "\n".join(rows)


# Activations that wait on the host: --offload_activations, the tier --fit tries after
# checkpointing. Checkpointing keeps only each block's input; on a long context even those add
# up (32 blocks x 16.8 MB per sequence of 2048 at Llama-2-7B's width), and they can wait in
# host memory until their block's backward needs them.


class _Parked:
    """A block input parked in host memory, its copy back, and the input parked before it."""

    def __init__(self, device, host, before):
        self.device = device
        self.host = host
        self.before = before
        self.back = None  # its copy back on the device, once issued
        self.done = None  # on CUDA, the event that the copy back records


class OffloadedInputs(torch.autograd.graph.saved_tensors_hooks):
    """While active, each checkpointed block's input (all that non-reentrant checkpointing
    saves of it) waits in pinned host memory, copied there on `stream` before the block runs;
    unpacking it fetches the block before's too, to overlap that copy with this backward."""

    def __init__(self, stream=None):
        self.stream = stream
        self.input = None  # the block input being parked
        self.host = None  # its host copy, on the way
        self.last = None  # the last _Parked: the chain runs back through .before
        super().__init__(self._pack, self._unpack)

    def start(self, x):
        """x: the next block's input, copied to the host now (None: no more blocks)."""
        self.input = x
        self.host = None if x is None else _to_host(x, self.stream)
        if x is None:
            self.last = None  # the chain of parked inputs ends
        return self

    def around(self, forward):
        """A block's forward(x, cos, sin, checkpointing, mask) that parks x while it runs."""

        def parked(x, cos, sin, checkpointing=False, mask=None):
            if not (checkpointing and torch.is_grad_enabled()):
                return forward(x, cos, sin, checkpointing, mask)
            try:
                with self.start(x):
                    return forward(x, cos, sin, checkpointing, mask)
            finally:
                self.input = None  # the hooks keep no block input alive

        return parked

    def _pack(self, t):
        x = self.input
        # By storage, not identity: FSDP's _PostBackward hands the block an alias of x.
        if x is None or t.shape != x.shape or t.data_ptr() != x.data_ptr():
            return t  # not a block input (RoPE's cos and sin): kept as it is
        self.last = _Parked(t.device, self.host, self.last)
        return self.last

    def _fetch(self, parked):
        """Issue the copy back of a parked input, once, into the compute stream's memory."""
        if parked is None or parked.back is not None:
            return
        host = parked.host
        parked.back = torch.empty(host.shape, dtype=host.dtype, device=parked.device)
        with _side(self.stream):
            parked.back.copy_(host, non_blocking=True)
            if self.stream is not None:
                # Made on the compute stream, written on this one: recorded here, so that an
                # error path that frees it before its use cannot let the allocator hand out its
                # memory while the copy still writes it.
                parked.back.record_stream(self.stream)
                # What the compute stream waits for: this copy, not the next one's.
                parked.done = torch.cuda.Event()
                parked.done.record()

    def _unpack(self, parked):
        if isinstance(parked, torch.Tensor):
            return parked
        self._fetch(parked)
        self._fetch(parked.before)  # the block before's, for its backward, which comes next
        t = parked.back
        if parked.done is not None:
            torch.cuda.current_stream(t.device).wait_event(parked.done)
        parked.back = None
        parked.done = None
        parked.before = None
        return t


# Tiles (--tile_tokens K): a checkpointed block's position-wise work, K tokens at a time. In a
# block only attention's core mixes positions; the norms, the projections with their adapters,
# RoPE, SwiGLU and the residual adds act on each token alone. So a block runs in three parts:
#   pre   x -> q, k, v      (the first norm, the q, k, v projections, RoPE)      over tiles
#   core  q, k, v -> y      (attention over the whole row or piece)              whole
#   post  y, x -> out       (o_proj, the residual, the second norm, SwiGLU, ...) over tiles
# A tiled part keeps only its inputs; its backward runs each tile's forward again, with grad,
# and that tile's backward at once (Arctic Long Sequence Training's TiledMLP, for the whole
# block). A block's backward then keeps per token its input, q, k, v, the attention's output and
# log-sum-exp, and their gradients; the SwiGLU's (tokens, ffn) intermediates and the norms' fp32
# copies are a tile's. What it costs: the pre part's forward once more (the checkpoint's
# recompute needs q, k and v; post's output it does not need, and post skips it there). The
# final norm runs over tiles too, and the loss in chunks of LOSS_CHUNK rows.


class _Tiled(torch.autograd.Function):
    """fn(*inputs) over tiles of `tile` tokens (dim 1) of the first n tensors, without grad;
    backward runs each tile again with grad. The other tensors are the trained ones fn reads:
    given, so that autograd reaches this node; their gradients accumulate as each tile's
    backward runs. like: the input whose shape fn's output has, where a checkpoint's recompute
    (inside backward) does not need the output (None: it does)."""

    @staticmethod
    def forward(ctx, fn, tile, like, n, *tensors):
        inputs = tensors[:n]
        ctx.fn = fn
        ctx.tile = tile
        ctx.save_for_backward(*inputs)
        # The random state, so that LoRA dropout draws the same masks again in backward.
        ctx.devices = [inputs[0].device] if inputs[0].is_cuda else []
        ctx.rng = [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in ctx.devices]
        if like is not None and torch._C._current_graph_task_id() != -1:
            # A recompute wants the saved inputs alone: its output is a placeholder, no memory.
            return like.new_zeros(()).expand(like.shape)
        T = inputs[0].shape[1]
        with torch.no_grad():  # (detached: the same compiled graph for the first block too)
            outs = [fn(*(t.narrow(1, s, tile).detach() for t in inputs)) for s in range(0, T, tile)]
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts, dim=1) for parts in zip(*outs))
        if outs[0].dim() == 0:  # a loss: the tiles' sum
            return torch.stack(outs).sum()
        return torch.cat(outs, dim=1)

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        wanted = ctx.needs_input_grad[4 : 4 + len(inputs)]
        grad_inputs = [torch.zeros_like(t) if w else None for t, w in zip(inputs, wanted)]
        with torch.random.fork_rng(devices=ctx.devices):
            torch.set_rng_state(ctx.rng[0])
            for device, state in zip(ctx.devices, ctx.rng[1:]):
                torch.cuda.set_rng_state(state, device)
            for start in range(0, inputs[0].shape[1], ctx.tile):
                _tile_backward(ctx, start, inputs, grads, grad_inputs)
        trained = len(ctx.needs_input_grad) - 4 - len(inputs)  # theirs accumulated already
        return (None, None, None, None, *grad_inputs) + (None,) * trained


def _tile_backward(ctx, start, inputs, grads, grad_inputs):
    """One tile's forward, with grad, and its backward at once: the trained tensors' gradients
    accumulate; the inputs' go into grad_inputs. Every floating input asks for its gradient, so
    that the first block's (whose input needs none) runs the compiled graph of the others."""
    part = [t.narrow(1, start, ctx.tile).detach() for t in inputs]
    part = [t.requires_grad_(t.is_floating_point()) for t in part]
    with torch.enable_grad():
        outs = ctx.fn(*part)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [g if g.dim() == 0 else g.narrow(1, start, ctx.tile) for g in grads]  # 0-d: a loss
    torch.autograd.backward(outs, grads)
    for g, t in zip(grad_inputs, part):
        if g is not None:
            g.narrow(1, start, ctx.tile).copy_(t.grad)


def _trained(*modules):
    """The trained tensors the modules read: under FSDP the full ones, while gathered."""
    found = []
    for m in modules:
        for sub in m.modules():
            for name, p in sub._parameters.items():
                if p is not None and p.requires_grad:
                    found.append(getattr(sub, name))
    return found


def check_tiles(plan):
    """Refuse, in one line, a --tile_tokens that does not divide a rank's piece of each row
    (every tile the same: one compiled graph serves them all)."""
    piece = plan.seq_len // plan.context_parallel
    k = plan.tile_tokens
    require(
        not k or piece % k == 0,
        f"--tile_tokens {k}: does not divide a rank's {piece} tokens of each row (--seq_len "
        f"{plan.seq_len} over --context_parallel {plan.context_parallel})",
    )


# A block's three parts, the block given (not closed over): compiled once, one graph serves
# every block and every tile.


def _pre(layer, x, cos, sin):
    """x (B, t, C), cos and sin (B or 1, t, hd) -> q, k, v (B, t, heads, hd), RoPE'd."""
    q, k, v = layer.self_attn.project(layer.input_layernorm(x))
    q = apply_rope(q.transpose(1, 2), cos[:, None], sin[:, None]).transpose(1, 2)
    k = apply_rope(k.transpose(1, 2), cos[:, None], sin[:, None]).transpose(1, 2)
    return q, k, v


def _core(layer, q, k, v, mask):
    """(B, T, heads, hd) each -> attention over the whole row or piece, (B, T, nh, hd): a view
    of attention's output, which it keeps anyway (o_proj's input is made a tile at a time)."""
    y = layer.self_attn.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
    return y.transpose(1, 2)


def _post(layer, y, x):
    h = x + layer.self_attn.o_proj(y.flatten(2))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _loss(norm, head, h, targets):
    """The final norm and the loss's sum over a tile's tokens."""
    return LMHead.forward(head, RMSNorm.forward(norm, h), targets, "sum")


def tile_the_loss(model, tile):
    """The final norm and the loss over tiles, in one: the norm's input kept, its fp32 copies,
    its output and the loss's buffers a tile's. (The logits, for generation, as before.)"""
    norm = model.model.norm
    head = model.lm_head
    loss = functools.partial(_loss, norm, head)

    def forward(h, targets=None, reduction="mean"):
        if targets is None:
            return LMHead.forward(head, RMSNorm.forward(norm, h))
        total = _Tiled.apply(loss, tile, None, 2, h, targets)
        count = (targets != IGNORE_INDEX).sum().clamp(min=1) if reduction == "mean" else 1
        return total / count

    norm.forward = lambda h: h  # the head applies it
    head.forward = forward


_COMPILED_PARTS = {}  # _pre, _core, _post -> compiled, made at the first use


def tiled(layer, tile, compile=False):
    """layer's forward(x, cos, sin, checkpointing, mask), its position-wise work over tiles of
    `tile` tokens (the comment above); compile: each part compiled, one graph for every tile."""
    parts = (_pre, _core, _post)
    if compile:
        parts = [_COMPILED_PARTS.get(fn) or torch.compile(fn) for fn in parts]
        _COMPILED_PARTS.update(zip((_pre, _core, _post), parts))
    pre, core, post = (functools.partial(fn, layer) for fn in parts)

    def block(x, cos, sin, mask=None):
        # cos and sin as (B or 1, T, hd), whether RoPE's positions were (T,) or (B, T)
        cos, sin = (t[None] if t.dim() == 2 else t[:, 0] for t in (cos, sin))
        attention = layer.self_attn
        q, k, v = _Tiled.apply(pre, tile, None, 3, x, cos, sin, *_trained(attention))
        y = core(q, k, v, mask)
        trained = _trained(attention.o_proj, layer.mlp)
        return _Tiled.apply(post, tile, x, 2, y, x, *trained)

    def forward(x, cos, sin, checkpointing=False, mask=None):
        if checkpointing and torch.is_grad_enabled():
            return checkpoint(block, x, cos, sin, mask, use_reentrant=False)
        return block(x, cos, sin, mask)

    return forward


# Section 1 counted the state that lives between steps. A step adds the all-gather buffers of
# section 5 and the activations autograd keeps for backward. Their peak comes in the loss or
# in the first block that backward runs: every checkpointed block input is alive then, plus
# the loss's buffers or that block's.


@dataclass(frozen=True)
class Plan:
    """How a run builds its model and runs a step, its rows and its memory: what --estimate
    predicts, --fit chooses and a run follows (the fields are the flags'). shard: the ranks that
    shard the state (all of them, or an HSDP group's); batch_size: rows per rank of a
    micro-batch."""

    batch_size: int = 8
    seq_len: int = 2048
    grad_accum: int = 1
    seed: int = 0
    dtype: str = "bf16"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    dora: bool = False
    nf4_head: bool = False
    pack: bool = False
    compile: bool = True
    checkpointing: bool = True
    offload_activations: bool = False
    cpu_offload: bool = False
    context_parallel: int = 1
    tile_tokens: int = 0  # a checkpointed block's position-wise work in tiles of this (0: none)
    shard: int = 1
    loss_chunk: int = LOSS_CHUNK

    @classmethod
    def of(cls, args, shard):
        """The plan the flags give, the state sharded over `shard` ranks."""
        flags = {f.name for f in dataclasses.fields(cls)} - {"shard", "loss_chunk"}
        return cls(shard=shard, **{name: getattr(args, name) for name in flags})

    def element_bytes(self):
        return DTYPES[self.dtype].itemsize

    def tokens(self):
        """Tokens of one rank's micro-batch (under context_parallel, its pieces)."""
        return self.batch_size * self.seq_len // self.context_parallel


def cublas_workspaces(capability=None):
    """(bytes, what they follow): cuBLAS's workspaces, one per thread that runs matmuls
    (forward's, backward's), as CUBLAS_WORKSPACE_CONFIG's ":KiB:count" pairs say, else torch's
    default: ":4096:8" on Hopper (sm90, capability None), ":4096:2:16:8" on others."""
    major, minor = capability or (9, 0)
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    said = f"CUBLAS_WORKSPACE_CONFIG={config}"
    if not config:
        config = ":4096:8" if (major, minor) == (9, 0) else ":4096:2:16:8"
        said = f"torch's default for sm{major}{minor}, {config}"
        if capability is None:
            said += " (Hopper's, assumed: no GPU here)"
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    kib = sum(int(size) * int(count) for size, count in pairs)
    return 2 * kib * 1024, said


@dataclass
class Estimate:
    """Predicted bytes per rank of a training step; each dict is rows of a table."""

    plan: Plan
    state: dict  # sharded, resident between steps (on the host with offload)
    gathers: float  # all-gather buffers
    activations: dict
    activation_peak: float
    workspaces: tuple  # cublas_workspaces'
    gpu_state: float  # the state's bytes on the GPU (0 with offload)
    host_state: float  # host memory for offloaded tensors
    gpu_peak: float
    load_peak: float  # while loading the checkpoint


def _nf4_bytes(n):
    return n * NF4_BITS_PER_PARAM / 8


def _pinned(n):
    """Bytes CUDA's pinned allocator takes for n: it rounds up to a power of two."""
    return 2 ** math.ceil(math.log2(n)) if n >= 1 else 0


def _block_unit_bytes(config, counts, elt):
    """The bytes of one block's unit, gathered: NF4 projections, two norms, adapters."""
    layers = config.num_hidden_layers
    d = config.hidden_size
    return _nf4_bytes(counts.linear / layers) + 2 * d * elt + (counts.lora / layers) * elt


def _block_bytes(config, counts, plan):
    """(saved, backward, core, core_backward, in_flight): bytes per token that one block saves
    for backward and that its backward adds beside them; of those, what attention's core saves
    and adds (a tiled block's for the whole piece); and the bytes of its backward not per
    token. Saved, op by op:
    each RMSNorm its fp32 input and its output; attention q, k, v, its output and an fp32
    log-sum-exp per head; o_proj's LoRA its input; SwiGLU the gate, both factors and the
    product; each projection its LoRA intermediate, and with DoRA its output before the
    magnitude's scale (for m's gradient). (NF4 linears save only their packed weight.) With
    LoRA dropout, each projection also keeps its dropped input (for A's gradient) and the
    dropout's mask (a byte each); DoRA then keeps three outputs instead of one: x W^T and
    d(x) W^T (the halves of one matmul of both) and its LoRA term, each scaled by m / n apart."""
    elt = plan.element_bytes()
    d = config.hidden_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes = linear_shapes(config).values()
    dropout = plan.lora_dropout > 0
    norms = 2 * (4 * d + elt * d)
    attention = elt * (3 * q_dim + 2 * kv_dim) + 4 * config.num_attention_heads
    mlp = elt * 4 * config.intermediate_size
    unscaled = elt * sum(out for out, _ in shapes) * (3 if dropout else 1) if plan.dora else 0
    dropped = (elt + 1) * sum(inp for _, inp in shapes) if dropout else 0
    saved = norms + attention + mlp + 7 * elt * plan.lora_rank + unscaled + dropped
    # Backward frees each saved tensor once its op's backward is done, so beside them there is
    # about one (tokens, ffn) gradient and one (tokens, d) at a time. Attention's backward
    # accumulates in fp32 (flash).
    backward = elt * (config.intermediate_size + d) + 4 * q_dim
    if plan.dora and dropout:  # x and d(x) stacked into one NF4 matmul: the widest input's
        backward += 2 * elt * max(inp for _, inp in shapes)
    # Attention's core: q, k, v, its output and log-sum-exp; in its backward their gradients and
    # its fp32 accumulators.
    core = attention - elt * q_dim  # (o_proj's input is another copy of the output)
    core_backward = elt * (2 * q_dim + 2 * kv_dim) + 4 * q_dim
    if plan.context_parallel > 1:
        # The all-to-alls' contiguous copies of q, k and v; and k and v repeated to lcm(nkv, N)
        # heads where N does not divide nkv, kept so by attention for backward.
        kv = math.lcm(config.num_key_value_heads, plan.context_parallel)
        repeated = 2 * (kv - config.num_key_value_heads) * config.head_dim * elt
        copies = elt * (q_dim + 2 * kv * config.head_dim)
        saved += repeated
        backward += copies
        core += repeated
        core_backward += copies
    # Not per token: the dense weight inside the NF4 matmul that runs (the largest
    # projection's), the block's adapter gradients, and the unit before's reduce-scatter input
    # and output (fp32), alive until this unit's is issued (section 5).
    largest = max(out * inp for out, inp in shapes)
    in_flight = elt * largest + counts.lora / config.num_hidden_layers * (elt + 4 + 4 / plan.shard)
    return saved, backward, core, core_backward, in_flight


def _loss_bytes(config, plan):
    """The loss's peak: the final norm's saved tensors, lm_head dense (an NF4 head dequantized; a
    dense one is the last unit's gathered weight), one chunk of logits and, compiled, their
    gradient (eager, at its peak, the fp32 copy of bf16 logits and the one-hot, bool and cast
    to fp32, instead), and the gradient wrt the hidden states."""
    elt = plan.element_bytes()
    tokens = plan.tokens()
    d = config.hidden_size
    tile = plan.batch_size * plan.tile_tokens  # tokens of a tile, every row's
    if plan.compile:
        per_logit = 2 * elt
    else:
        per_logit = elt + 4 * (elt != 4) + 1 + 4
    chunk_rows = min(plan.loss_chunk, tile or tokens)  # tiled: a chunk of a tile
    norm = tokens * (4 * d + elt * d)
    if tile:  # its input alone: the rest a tile's, with the loss's
        norm = tokens * elt * d
    vocab = config.vocab_size
    return norm + vocab * d * elt + chunk_rows * vocab * per_logit + tokens * d * elt


def _activation_rows(config, counts, plan):
    """(rows, peak) of the activations of one rank's micro-batch."""
    elt = plan.element_bytes()
    tokens = plan.tokens()
    d = config.hidden_size
    layers = config.num_hidden_layers
    saved, backward, core, core_backward, in_flight = _block_bytes(config, counts, plan)
    tile = plan.batch_size * plan.tile_tokens  # tokens of a tile, every row's
    rows = {}
    if plan.checkpointing and plan.offload_activations:
        # On the host; the block's own input and the next one's (prefetched) on the GPU.
        rows["checkpointed block inputs (host)"] = layers * tokens * elt * d
        kept = 2 * tokens * elt * d
        rows["checkpointed block inputs back on the GPU (2)"] = kept
    elif plan.checkpointing:
        kept = layers * tokens * elt * d
        rows["checkpointed block inputs"] = kept
    else:
        kept = layers * tokens * saved
        rows["saved activations, all blocks"] = kept
    if plan.checkpointing and tile:
        # Attention's core saves for the whole piece; beside it, at the peak, either a tile's
        # backward of the post part (its inputs' gradients whole: the output's, the block
        # input's) or the core's own backward.
        q_dim = config.num_attention_heads * config.head_dim
        post = tokens * elt * (q_dim + d) + tile * (saved + backward - core)
        block = tokens * core + max(post, tokens * core_backward) + in_flight
        rows["recomputed block: attention's whole, the rest a tile's"] = block
    elif plan.checkpointing:
        block = tokens * (saved + backward) + in_flight
        rows["recomputed block (forward + backward)"] = block
    else:
        block = tokens * backward + in_flight
        rows["block backward gradients"] = block
    loss = _loss_bytes(config, plan)
    rows["loss: norm, lm_head dense, logits chunk, grad_h"] = loss
    if plan.pack:
        # Kept for the whole step: each token's document and position (int64), RoPE's cos and
        # sin at each token's position, and on the CPU SDPA's (B, 1, T, T) bool mask
        # (flex_attention's block mask on CUDA is (T / 128)^2 per row). Each block's SDPA
        # turns the bool mask into an additive one in the compute dtype, saved for backward:
        # the recomputed block's alone, or without checkpointing every block's. Under
        # --context_parallel the masks span the whole rows.
        whole = tokens * plan.context_parallel * plan.seq_len  # (B, 1, T, T)
        mask = whole + 16 * tokens + 2 * tokens * config.head_dim * elt
        additive = whole * elt
        if plan.checkpointing:
            block += additive
        else:
            mask += layers * additive
        row = mask + (additive if plan.checkpointing else 0)
        rows["document mask, positions, RoPE per token (--pack)"] = row
        kept += mask
    # The loss's buffers are gone before the blocks' backward, where the incoming gradient
    # (tokens x d) joins.
    peak = kept + max(block + tokens * d * elt, loss)
    return rows, peak


def _host_bytes(config, counts, plan):
    """Host memory for offloaded tensors, per rank: pinned allocations (shards, masters,
    their gradients, block inputs) round up to a power of two; AdamW's moments are pageable."""
    elt = plan.element_bytes()
    tokens = plan.tokens()
    world = plan.shard
    layers = config.num_hidden_layers
    d = config.hidden_size
    host = 0
    if plan.checkpointing and plan.offload_activations:
        host += layers * _pinned(tokens * elt * d)
    if plan.cpu_offload:
        # The shards of the embeddings, of norm + lm_head, and of each block with its masters
        # and their gradients.
        block_unit = _block_unit_bytes(config, counts, elt)
        unit = _pinned(block_unit / world) + 2 * _pinned(4 * counts.lora / layers / world)
        host += _pinned(config.vocab_size * d * elt / world)
        head = _nf4_bytes(counts.head) if plan.nf4_head else counts.head * elt
        host += _pinned((head + d * elt) / world)
        host += 8 * counts.lora / world + ADAM_CHUNK_BYTES["cpu"] + layers * unit
    return host


def estimate_memory(config, plan=Plan(), capability=None):
    """Predicted bytes per rank of a QLoRA step as this file runs it, by `plan`, on a GPU of
    this compute capability (None: Hopper's): 1/shard of the state, and the activations of the
    rank's micro-batch (under context_parallel, its pieces of the rows), op by op."""
    elt = plan.element_bytes()
    counts = count_family_params(config, plan.lora_rank, dora=plan.dora)
    shard = plan.shard
    head_nf4 = counts.head if plan.nf4_head else 0
    # The sharded state that lives between steps.
    state = {
        "NF4 weights (shard)": _nf4_bytes(counts.linear + head_nf4) / shard,
        "frozen dense weights (shard)": (counts.dense + counts.head - head_nf4) * elt / shard,
        "adapters fp32 + wire copy (shard)": counts.lora * (4 + elt) / shard,
        "adapter gradients fp32 (shard)": 4 * counts.lora / shard,
        # m and v. AdamW's sqrt(v) lives only during its step, when backward's buffers are gone.
        "AdamW state fp32 (shard)": 8 * counts.lora / shard,
    }
    # All-gathers: two block units at a time, the one being computed and the next one's
    # receive buffer (prefetched after the copy-out, whose receive buffer is gone by then).
    gathers = 2 * _block_unit_bytes(config, counts, elt)
    activations, activation_peak = _activation_rows(config, counts, plan)
    gpu_state = 0 if plan.cpu_offload else sum(state.values())
    # Loading streams one weight at a time: the largest, dense in the compute dtype, and its NF4.
    linears = [out * inp for out, inp in linear_shapes(config).values()]
    largest = max(config.vocab_size * config.hidden_size, *linears)
    load_peak = gpu_state + largest * (elt + NF4_BITS_PER_PARAM / 8)
    workspaces = cublas_workspaces(capability)
    return Estimate(
        plan=plan,
        state=state,
        gathers=gathers,
        activations=activations,
        activation_peak=activation_peak,
        gpu_state=gpu_state,
        host_state=_host_bytes(config, counts, plan),
        gpu_peak=gpu_state + gathers + activation_peak + workspaces[0],
        load_peak=load_peak,
        workspaces=workspaces,
    )


def format_estimate(name, est):
    offload = est.plan.cpu_offload
    where = "host" if offload else "GPU"
    rows = [(f"{row} ({where})", n) for row, n in est.state.items()]
    rows.append(("all-gather buffers (1 gathered + 1 receiving)", est.gathers))
    rows.extend(est.activations.items())
    rows.append(("CUDA workspaces (cuBLAS, 2 threads)", est.workspaces[0]))
    rows.append(("predicted peak per GPU", est.gpu_peak))
    rows.append(("while loading (one weight at a time), per GPU", est.load_peak))
    if est.host_state > 0:
        rows.append(("predicted host memory for offloaded tensors", est.host_state))
    title = f"predicted memory per rank, {name}, the state sharded over {est.plan.shard} ranks"
    if offload:
        title += ", offloaded to the host"
    lines = [title + ":"]
    for row, n in rows:
        lines.append(f"  {row:<48} {n / GiB:8.3f} GiB")
    lines.append(f"  (cuBLAS's workspaces: {est.workspaces[1]})")
    return "\n".join(lines)


def shard_size(size, world, local):
    """The ranks that shard the state: --shard_size (size), else a machine's `local` ranks when
    a run spans machines (HSDP: all-gathers stay within one), else all of them."""
    size = size or (local if local < world else world)
    require(world % size == 0, f"--shard_size {size}: does not divide the {world} ranks")
    return size


# --fit: the fastest setting that the estimate says fits. What it tries, fastest first on a GPU
# (the README says what each costs), each with every micro-batch that divides this rank's
# batch, the largest first. --grad_accum makes up a smaller micro-batch: the same batch, the
# same rows.
FIT_MARGIN = 0.1  # --fit with no number, on CUDA: the free memory less this share of the total
FIT_FLAGS = (
    "batch_size grad_accum checkpointing offload_activations cpu_offload tile_tokens".split()
)
TILE_SIZES = (4096, 2048, 1024, 512)  # tiles --fit tries, largest (fewest passes) first


# Without --cpu_offload, then with it; in each, the activations kept, checkpointed, then
# checkpointed with the block inputs on the host.
FIT_TIERS = [
    dict(checkpointing=checkpointing, offload_activations=offload, cpu_offload=cpu_offload)
    for cpu_offload in (False, True)
    for checkpointing, offload in ((False, False), (True, False), (True, True))
]


def fit_plans(plan, rows=None):
    """Every plan --fit tries, in order: `plan` with FIT_FLAGS set, each keeping `rows` of this
    rank per step (batch_size x grad_accum). Tiles come last, when nothing else fits: the
    checkpointed tiers again with each of TILE_SIZES that divides a rank's piece of a row."""
    rows = rows or plan.batch_size * plan.grad_accum
    micro_batches = [micro for micro in range(rows, 0, -1) if rows % micro == 0]
    piece = plan.seq_len // plan.context_parallel
    tiles = [k for k in TILE_SIZES if k < piece and piece % k == 0]
    tiers = [dict(tier, tile_tokens=0) for tier in FIT_TIERS]
    tiers += [dict(t, tile_tokens=k) for k in tiles for t in FIT_TIERS if t["checkpointing"]]
    return [
        dataclasses.replace(plan, batch_size=micro, grad_accum=rows // micro, **tier)
        for tier in tiers
        for micro in micro_batches
    ]


def plan_name(plan):
    name = f"micro-batch {plan.batch_size} x {plan.grad_accum}"
    if plan.checkpointing:
        name += ", checkpointing"
    if plan.offload_activations:
        name += ", --offload_activations"
    if plan.cpu_offload:
        name += ", --cpu_offload"
    if plan.context_parallel > 1:
        name += f", --context_parallel {plan.context_parallel}"
    if plan.tile_tokens:
        name += f", --tile_tokens {plan.tile_tokens}"
    return name


def host_available():
    """Bytes of memory this machine can still give (Linux's MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024  # kB
    except (OSError, KeyError, ValueError):
        return None


class Budget(NamedTuple):
    """What a plan must fit in: bytes per GPU, and bytes of host memory for the ranks of this
    machine (inf where unknown); cpu: the ranks compute on the host, their state there too."""

    gpu: float
    host: float
    local_ranks: int = 1
    cpu: bool = False


def budget_of(device, fit=None, local_ranks=1):
    """This machine's Budget, the least over the ranks. Per GPU: --fit's GIB (fit), or its free
    memory less FIT_MARGIN of its whole ("auto"), or its free memory (None; no bound on a CPU).
    And the host memory available."""
    cuda = device.type == "cuda"
    require(fit != "auto" or cuda, "--fit: on a CPU give the memory to fit in, e.g. --fit 20")
    if fit not in (None, "auto"):
        gpu = fit * GiB
    elif cuda:
        free, total = torch.cuda.mem_get_info(device)
        gpu = free - (FIT_MARGIN * total if fit else 0)
    else:
        gpu = math.inf
    host = host_available() or math.inf
    if dist.is_initialized():
        t = torch.tensor([gpu, host], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        gpu, host = t.tolist()
    return Budget(gpu, host, local_ranks, not cuda)


def shortfall(est, budget, whole_step=True):
    """Why an estimate does not fit a budget, in words (None: it fits): the step's peak per GPU
    (whole_step), else the state alone, which a run needs before its first step; then the host
    memory of this machine's ranks (on a CPU the "GPU" state too, which lives there)."""
    gpu = est.gpu_peak if whole_step else est.gpu_state
    if gpu > budget.gpu:
        return f"{gpu / GiB:.2f} GiB per GPU, {budget.gpu / GiB:.2f} GiB is available"
    host = (est.host_state + (gpu if budget.cpu else 0)) * budget.local_ranks
    if host > budget.host:
        need = f"{host / GiB:.2f} GiB of host memory for {budget.local_ranks} rank(s)"
        return f"{need}, {budget.host / GiB:.2f} GiB is available"
    return None


def fit(config, plan, budget, capability=None):
    """The first of fit_plans(plan) that fits the budget on a GPU of this compute capability
    (estimate_memory's), every plan tried printed; none: one error naming the smallest peak (the
    last plan's)."""
    said = f"--fit: {budget.gpu / GiB:.2f} GiB per GPU"
    if budget.host < math.inf:
        said += f", {budget.host / GiB:.1f} GiB of host memory"
    print0(said)
    for trial in fit_plans(plan):
        est = estimate_memory(config, trial, capability)
        why = shortfall(est, budget)
        peak = est.gpu_peak / GiB
        verdict = "fits" if why is None else "too big"
        if why is not None and "host memory" in why:
            verdict = "its host memory is not available"
        print0(f"  {plan_name(trial):<62} {peak:8.2f} GiB  {verdict}")
        if why is None:
            print0(f"--fit chose {plan_name(trial)}: {peak:.2f} GiB predicted per GPU")
            return trial
    raise UserError(
        f"--fit: no setting fits; the smallest predicted peak is {peak:.2f} GiB "
        f"({plan_name(trial)}): it needs {why}"
    )


# -----------------------------------------------------------------------------
# 14. Hugging Face files: safetensors in and out, PEFT adapters, resumable checkpoints
# -----------------------------------------------------------------------------
# Needs: import dataclasses, functools, json, math, os, re, shutil, time, numpy as np, torch,
# torch.distributed as dist, torch.nn as nn; from typing import NamedTuple; from above:
# sections 1-13.
#
# safetensors: an 8-byte little-endian header length N, N bytes of JSON
#   {"name": {"dtype": "BF16", "shape": [out, in], "data_offsets": [begin, end]},
#    "__metadata__": {...}}
# then the raw little-endian bytes, the offsets relative to the end of the header.

SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def read_json(path, raw=None, what="file"):
    """The JSON object in file `path`, or in `raw` (bytes read from it)."""
    if raw is None:
        require(os.path.isfile(path), f"{path}: no such file")
        with open(path, "rb") as f:
            raw = f.read()
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: {what} is not valid JSON ({getattr(e, 'msg', e)})") from None
    require(isinstance(obj, dict), f"{path}: {what} is not a JSON object")
    return obj


class TensorEntry(NamedTuple):
    """Where one tensor lies in a .safetensors file, relative to the end of the header."""

    dtype: torch.dtype
    shape: list
    begin: int
    end: int


def _header_entry(where, e, data_size):
    """A header entry as a TensorEntry, every field and offset checked."""
    try:
        dtype = e["dtype"]
        shape = [int(n) for n in e["shape"]]
        begin, end = map(int, e["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{where}: malformed header entry") from None
    require(dtype in SAFETENSORS_DTYPES, f"{where}: unsupported dtype {dtype}")
    require(
        0 <= begin <= end <= data_size,
        f"{where}: offsets [{begin}, {end}] run past the end of the data "
        f"({data_size} bytes): truncated file?",
    )
    nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
    require(end - begin == nbytes, f"{where}: {end - begin} bytes for shape {shape} {dtype}")
    return TensorEntry(SAFETENSORS_DTYPES[dtype], shape, begin, end)


class SafetensorsFile:
    """A .safetensors file's header, {name: TensorEntry}, every offset checked before a byte
    is read; get(name) reads one tensor."""

    def __init__(self, path):
        require(os.path.isfile(path), f"{path}: no such file")
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            # A file under 8 bytes fails the next check too.
            n = int.from_bytes(f.read(8), "little")
            require(
                8 + n <= size,
                f"{path}: header length {n} runs past the end of the file ({size} bytes)",
            )
            header = read_json(path, f.read(n), what="header")
        self.metadata = header.pop("__metadata__", None) or {}  # strings, not a tensor
        require(isinstance(self.metadata, dict), f"{path}: __metadata__ is not an object")
        self.data_start = 8 + n
        data_size = size - self.data_start
        self.entries = {}
        for name, e in header.items():
            self.entries[name] = _header_entry(f"{path}: tensor {name}", e, data_size)
        spans = sorted((e.begin, e.end, name) for name, e in self.entries.items())
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            require(begin >= end, f"{path}: tensors {a} and {b} overlap in the file")

    def get(self, name):
        e = self.entries[name]
        n = e.end - e.begin
        # np.fromfile gives the tensor memory of its own.
        raw = np.fromfile(self.path, np.uint8, n, offset=self.data_start + e.begin)
        require(raw.size == n, f"{self.path}: tensor {name} is cut short (the file shrank?)")
        if not raw.size:
            return torch.empty(e.shape, dtype=e.dtype)
        return torch.from_numpy(raw).view(e.dtype).view(e.shape)


def atomic_write(path, write, mode="wb"):
    """write(f) into a file beside path, then rename: readers see the old file or the new one,
    never half; each process writes its own (path.PID.tmp), so two writing at once do not mix."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a full disk, a directory in the way
        if os.path.isfile(tmp):
            os.remove(tmp)
        why = getattr(e, "strerror", None) or type(e).__name__
        raise UserError(f"{path}: cannot be written ({why})") from None


def write_json(path, obj):
    atomic_write(path, lambda f: json.dump(obj, f, indent=2), "w")


def save_safetensors(path, specs, get, metadata=None):
    """Write tensors to `path` one at a time, atomically; specs: [(name, dtype, shape)];
    metadata: {str: str}, beside the "format" that transformers' loader asks of a file."""
    header = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned

    def write(f):
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, dtype, shape in specs:
            # A copy, always: never export our own storage.
            t = get(name).detach().to("cpu", dtype, copy=True).contiguous()
            assert tuple(t.shape) == tuple(shape), name
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())

    atomic_write(path, write)


def _is_count(x):
    return type(x) is int and x >= 1  # JSON's true is no count


def _is_positive(x):
    return type(x) in (int, float) and math.isfinite(x) and x > 0


# The families this file follows, by config.json's model_type, and the class transformers
# builds for each, named after it: LlamaForCausalLM... (section 7 has what sets them apart).
ARCHITECTURES = {f: f.capitalize() + "ForCausalLM" for f in ("llama", "mistral", "qwen2", "qwen3")}


def _family(d, where):
    """config.json's model_type, or the family its architectures name; another is refused."""
    model_type = d.get("model_type")
    if model_type is None:
        for family, architecture in ARCHITECTURES.items():
            if architecture in (d.get("architectures") or []):
                model_type = family
    families = ", ".join(ARCHITECTURES)
    require(
        model_type in ARCHITECTURES,
        f"{where}: model_type {model_type!r} is not one this file follows ({families})",
    )
    return model_type


def _config_kwargs(d, where):
    """LlamaConfig's keywords from a config.json dict, in the transformers 4 or 5 layout."""
    kwargs = {
        f.name: d[f.name] for f in dataclasses.fields(FamilyConfig) if d.get(f.name) is not None
    }
    kwargs["model_type"] = _family(d, where)
    # transformers 5 moved the RoPE settings under one key.
    rope = d.get("rope_parameters")
    require(isinstance(rope, (dict, type(None))), f"{where}: rope_parameters must be an object")
    if rope:
        kwargs["rope_theta"] = rope.get("rope_theta", kwargs.get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            kwargs["rope_scaling"] = rope
    # Qwen's sliding window is off unless use_sliding_window says so; then it is refused.
    if kwargs["model_type"] in ("qwen2", "qwen3"):
        window = d.get("use_sliding_window")
        require(
            window in (None, False),
            f"{where}: use_sliding_window {window!r}: sliding-window attention is not followed "
            f"by this file",
        )
        kwargs.pop("sliding_window", None)
    return kwargs


def _check_rope(c, check):
    scaling = c.rope_scaling if isinstance(c.rope_scaling, dict) else {"rope_type": "default"}
    rope_type = scaling.get("rope_type", scaling.get("type"))  # "type": older transformers
    check(rope_type in ("llama3", "default"), f"rope_scaling type {rope_type!r} is not supported")
    check(_is_positive(c.rope_theta), "rope_theta must be a positive number")
    if rope_type != "llama3":
        return
    check(_is_positive(scaling.get("factor")), "llama3 rope_scaling needs a positive factor")
    low = scaling.get("low_freq_factor", 1.0)  # Meta's defaults
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    ok = _is_positive(low) and _is_positive(high) and low < high and _is_count(old_len)
    check(
        ok,
        "llama3 rope_scaling needs positive low_freq_factor < high_freq_factor and a positive "
        "integer original_max_position_embeddings",
    )


def _check_config(c, d, where):
    """Every field this file uses, checked for its type and range, in order."""

    def check(ok, what):
        require(ok, f"{where}: {what}")

    for key in ("max_position_embeddings", "head_dim"):
        check(_is_count(getattr(c, key)), f"{key} must be a positive integer")
    check(c.head_dim % 2 == 0, "head_dim must be even (RoPE rotates its halves)")
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        value = getattr(c, key)
        check(type(value) is bool, f"{key} must be true or false, not {value!r}")
    act = d.get("hidden_act", "silu")
    check(act == "silu", f"hidden_act {act!r} is not supported (SwiGLU's is silu)")
    check(isinstance(c.rope_scaling, (dict, type(None))), "rope_scaling must be an object")
    _check_rope(c, check)
    check(_is_positive(c.rms_norm_eps), "rms_norm_eps must be a positive number")
    kv = c.num_key_value_heads
    kv_ok = _is_count(kv) and c.num_attention_heads % kv == 0
    check(kv_ok, "num_key_value_heads must divide num_attention_heads")
    window = c.sliding_window
    check(window is None or _is_count(window), "sliding_window must be a positive integer")
    sizes = [out * inp for out, inp in linear_shapes(c).values()]
    check(
        all(n % 64 == 0 for n in sizes + [c.vocab_size * c.hidden_size]),
        "every weight's size must be a multiple of 64 (NF4's block)",
    )


def config_from_hf(d, where="config.json"):
    """FamilyConfig from a config.json dict (transformers 4 or 5 layout): Llama, Mistral, Qwen2,
    Qwen3; each field checked; one not followed (a sliding window in use) refused."""
    kwargs = _config_kwargs(d, where)
    sizes = "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads"
    for key in sizes.split():
        require(_is_count(kwargs.get(key)), f"{where}: {key} is missing or not a positive integer")
    c = FamilyConfig(**kwargs)
    _check_config(c, d, where)
    return c


def config_to_hf(config, dtype):
    """config.json for this config's family, as transformers writes it."""
    config = as_family(config)
    d = {f.name: getattr(config, f.name) for f in dataclasses.fields(FamilyConfig)}
    d.update(
        architectures=[ARCHITECTURES[config.model_type]],
        torch_dtype=str(dtype).split(".")[-1],
        hidden_act="silu",
    )
    if config.model_type in ("qwen2", "qwen3"):
        d["use_sliding_window"] = False
    return {k: v for k, v in d.items() if v is not None}


def _checkpoint_files(path):
    """The .safetensors file names of the checkpoint directory `path`."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return ["model.safetensors"]
    weight_map = read_json(index).get("weight_map")
    is_map = isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
    require(is_map, f"{index}: not a safetensors index (no weight_map of file names)")
    for name, file in weight_map.items():
        # A plain file name: nothing outside the checkpoint is read.
        plain = os.path.basename(file) == file and file not in ("", ".", "..") and "/" not in file
        require(
            plain, f"{index}: entry {name} names {file!r}, not a file in the checkpoint directory"
        )
    return list(dict.fromkeys(weight_map.values()))


def load_checkpoint(path, config):
    """{name: (SafetensorsFile, its name there)} of a Hugging Face directory's weights, every
    header checked against config.json first: a mismatch is refused before a tensor is read."""
    config = as_family(config)
    files = [SafetensorsFile(os.path.join(path, n)) for n in _checkpoint_files(path)]
    # name -> (file, its name there). Old checkpoints also store RoPE's constants.
    sources = {}
    for sf in files:
        for name in sf.entries:
            if not name.endswith("rotary_emb.inv_freq"):
                sources[name] = (sf, name)
    if config.tie_word_embeddings and "model.embed_tokens.weight" in sources:
        sources.setdefault("lm_head.weight", sources["model.embed_tokens.weight"])  # tied
    layers = config.num_hidden_layers
    for name, (sf, key) in sources.items():
        entry = sf.entries[key]
        block = re.fullmatch(r"model\.layers\.(0|[1-9][0-9]*)\..+", name)
        layer = int(block[1]) if block and int(block[1]) < layers else None
        want = hf_shapes(config, layer).get(name)
        where = f"{sf.path}: tensor {name}"
        require(
            want is not None, f"{sf.path}: unexpected tensor {name} for a model of this config.json"
        )
        require(
            tuple(entry.shape) == want,
            f"{where} has shape {entry.shape}, config.json implies {list(want)}",
        )
        require(
            entry.dtype.is_floating_point,
            f"{where} is {DTYPE_NAMES[entry.dtype]}, not floating point",
        )
    # Each name present is expected (above): the missing are counted, not listed, and one named.
    n = len(hf_shapes(config)) + layers * len(hf_shapes(config, 0)) - len(sources)
    if n:
        expected = (name for i in (None, *range(layers)) for name in hf_shapes(config, i))
        first = next(name for name in expected if name not in sources)
        raise UserError(f"{path}: {n:,} tensors missing from the checkpoint, e.g. {first}")
    return sources


def initial_weights(shapes, seed, device="cpu", magnitudes=None):
    """(name, full tensor) of parameters with no checkpoint, as the modules draw them, one
    at a time from generators seeded by name on `device` (lora_A's on the CPU).
    magnitudes: DoRA's, dora_magnitudes(model), once the base is loaded."""
    for name, shape in shapes.items():
        if name.endswith("lora_magnitude_vector"):  # W's row norms
            yield name, magnitudes[name].cpu()
        elif name.endswith("lora_A"):
            yield name, lora_A_init(shape, seeded(seed, name))
        elif name.endswith(("lora_B", ".bias")):  # B = 0: the model starts as the base
            yield name, torch.zeros(shape, device=device)
        elif "norm" in name:
            yield name, torch.ones(shape, device=device)
        elif "embed_tokens" in name:  # N(0, 1)
            generator = seeded(seed, name, device=device)
            yield name, torch.randn(shape, generator=generator, device=device)
        else:  # the linears: N(0, 1/in)
            yield name, random_weight(shape, seeded(seed, name, device=device))


def load_weights(model, params, tensors, put, device):
    """Each (name, full tensor) put in place by put(name, t) as its parameter in `params` (the
    model's, as built on "meta") is to be: in its dtype, on `device`, an NF4 weight quantized as
    its module quantizes. A DoRA layer takes its W's row norms here, where the whole of W passes."""
    for name, t in tensors:
        p = params[name]
        t = t.to(device, p.dtype)
        if isinstance(p, NF4Tensor):
            module = model.get_submodule(name.rpartition(".")[0])
            t = to_nf4(t, compile=module.compile_kernels)
            if isinstance(module, DoRALinear):
                module.weight_loaded(t)
        put(name, t)


def _assign(model, name, t):
    """t in place of the parameter `name` of a model built on "meta", trainable if that was."""
    path, _, attr = name.rpartition(".")
    trainable = model.get_parameter(name).requires_grad
    setattr(model.get_submodule(path), attr, nn.Parameter(t, requires_grad=trainable))


def _finite(tensors, path):
    """The (name, tensor) stream of the checkpoint at `path`, each checked for inf and NaN."""
    for name, t in tensors:
        require(t.isfinite().all(), f"{path}: tensor {name} holds inf or NaN")
        yield name, t


PROGRESS_S = 10.0  # seconds between progress lines (loading here; tokenizing, a run below)


def progress(items, what, total, nbytes, compiling=False):
    """(name, tensor) items as they come, with a line on rank 0 every PROGRESS_S: done, and
    from the second line the rate since the line before and the time left (the first's time
    holds the fixed costs: `compiling` says they include the kernels' compiles); one more line
    at the end."""
    start = time.perf_counter()
    said = None  # (time, bytes) at the last line
    n = 0
    done = 0
    for n, (name, t) in enumerate(items, 1):
        done += t.nbytes  # the bytes read (in a checkpoint's dtype) or drawn
        yield name, t
        now = time.perf_counter()
        if now - (said[0] if said else start) < PROGRESS_S:
            continue
        line = f"{what}: {n:,}/{total:,} tensors, {fmt_bytes(done)} of {fmt_bytes(nbytes)}"
        if said and now > said[0]:
            rate = (done - said[1]) / (now - said[0])
            left = max(0, nbytes - done) / max(rate, 1e-9)
            line += f", {fmt_bytes(rate)}/s, {left:.0f} s left"
        elif compiling:
            line += ", compiling the NF4 kernels"
        said = (now, done)
        print0(line)
    seconds = max(time.perf_counter() - start, 1e-9)
    print0(
        f"{what}: {n:,} tensors, {fmt_bytes(done)} in {seconds:.1f} s "
        f"({fmt_bytes(done / seconds)}/s)"
    )


def load_model(make, seed, device, sources=None, path=None, shard=None):
    """(model, fsdp): make() built on "meta", then filled one full tensor at a time, never a bf16
    model: the base, the checkpoint's at `path` (sources: load_checkpoint(path)'s) or drawn, then
    fresh adapters (after it: DoRA's magnitudes start at its W's row norms). shard: FSDP's
    keywords; an FSDP made first keeps this rank's pieces of each tensor. Without it the model
    is whole, and fsdp None."""
    with torch.device("meta"):
        model = make()
    params = dict(model.named_parameters())  # what each is to be, read before FSDP takes them
    fsdp = FSDP(model, model.units(), device, model.dtype, **shard) if shard else None
    put = functools.partial(_assign, model) if fsdp is None else fsdp.load_full
    shapes = {name: p.shape for name, p in params.items() if not p.requires_grad}
    if sources is None:  # a random base, drawn in fp32
        what = "drawing a random base"
        nbytes = 4 * sum(map(math.prod, shapes.values()))
        tensors = initial_weights(shapes, seed, device)
    else:  # read one tensor at a time
        what = f"loading {path}"
        nbytes = sum(sf.entries[key].end - sf.entries[key].begin for sf, key in sources.values())
        tensors = _finite(((name, sf.get(key)) for name, (sf, key) in sources.items()), path)
    compiling = model.lm_head.compile_kernels  # the NF4 kernels compile as the first loads
    base = progress(tensors, what, len(shapes), nbytes, compiling)
    load_weights(model, params, base, put, device)
    adapters = {name: p.shape for name, p in params.items() if p.requires_grad}
    adapters = initial_weights(adapters, seed, magnitudes=dora_magnitudes(model))
    load_weights(model, params, adapters, put, device)
    return model, fsdp


def from_pretrained(
    path,
    dtype=torch.bfloat16,
    lora_rank=8,
    lora_alpha=16.0,
    lora_dropout=0.0,
    device=None,
    seed=0,
    nf4_head=False,
    dora=False,
):
    """A CausalLM (Llama, Mistral, Qwen2, Qwen3) with fresh adapters (DoRA's with dora) from a
    Hugging Face directory: load_model's, unsharded (memory stays near the NF4 size)."""
    config_path = os.path.join(path, "config.json")
    config = config_from_hf(read_json(config_path), config_path)
    sources = load_checkpoint(path, config)  # every header checked
    lora = (lora_rank, lora_alpha, lora_dropout)
    make = functools.partial(CausalLM, config, dtype, *lora, nf4_head=nf4_head, dora=dora)
    return load_model(make, seed, device or "cpu", sources, path)[0]


# Llama's (section 7), as the API has it: registered here, where the reader is.
Llama.from_pretrained = staticmethod(from_pretrained)

# PEFT's adapter format: what peft.PeftModel.from_pretrained(base, DIR) loads.
PEFT_PREFIX = "base_model.model."
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_config(rank, alpha, dropout, dora, base=""):
    """adapter_config.json, as PEFT reads it: the adapters' shape, on which base model."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": TARGET_MODULES,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": base,
        "use_dora": dora,
    }


def save_adapters(out_dir, adapters, peft):
    """adapter_model.safetensors (keys base_model.model.<name>.lora_A.weight; DoRA's magnitude
    has no .weight), and peft (peft_config's) as adapter_config.json."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for name, t in adapters.items():
        suffix = "" if name.endswith("lora_magnitude_vector") else ".weight"
        tensors[PEFT_PREFIX + name + suffix] = t.float()
    specs = [(key, torch.float32, tuple(t.shape)) for key, t in tensors.items()]
    save_safetensors(os.path.join(out_dir, "adapter_model.safetensors"), specs, tensors.__getitem__)
    write_json(os.path.join(out_dir, "adapter_config.json"), peft)


def load_adapters(path):
    """{name: tensor} from a PEFT adapter directory (the inverse of save_adapters)."""
    sf = SafetensorsFile(os.path.join(path, "adapter_model.safetensors"))
    return {key[len(PEFT_PREFIX) :].removesuffix(".weight"): sf.get(key) for key in sf.entries}


def peft_settings(path):
    """The Plan's lora_rank, lora_alpha and dora of the PEFT adapters in directory `path`,
    refused in one line where they are not LoRA (or DoRA) as this file has it."""
    where = os.path.join(path, "adapter_config.json")
    peft = read_json(where)
    kind = peft.get("peft_type")
    require(kind == "LORA", f"{where}: peft_type {kind!r}: this file loads LORA adapters")
    targets = peft.get("target_modules")
    ok = isinstance(targets, list) and targets and set(targets) <= set(TARGET_MODULES)
    require(
        ok, f"{where}: target_modules {targets!r}: this file adapts {', '.join(TARGET_MODULES)}"
    )
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        require(not peft.get(key), f"{where}: {key} is not followed by this file")
    require(not peft.get("use_rslora"), f"{where}: use_rslora is not followed by this file")
    require(peft.get("bias", "none") == "none", f"{where}: bias: this file trains no biases")
    rank = peft.get("r")
    alpha = peft.get("lora_alpha")
    require(_is_count(rank) and _is_positive(alpha), f"{where}: r or lora_alpha is no number")
    return dict(lora_rank=rank, lora_alpha=float(alpha), dora=peft.get("use_dora") is True)


def read_adapter(path, shapes):
    """--adapter's tensors {name: tensor}, checked before anything is built: those of its
    target modules, every one of `shapes` (a model's adapters) there, none else. A projection
    it does not target keeps B = 0 (DoRA's magnitude ||W||): the base's output."""
    targets = read_json(os.path.join(path, "adapter_config.json"))["target_modules"]
    want = {n: s for n, s in shapes.items() if n.rsplit(".", 2)[-2] in targets}
    adapters = load_adapters(path)
    for name, t in adapters.items():
        require(
            want.get(name) == tuple(t.shape),
            f"--adapter {path}: {name} {list(t.shape)} is not this model's "
            f"({list(want[name]) if name in want else 'no such tensor'})",
        )
    missing = [name for name in want if name not in adapters]
    require(not missing, f"--adapter {path}: {len(missing)} tensors missing, e.g. {missing[:1]}")
    return adapters


# The flags a checkpoint is saved with that --resume must be given again.
RESUME_MUST_MATCH = (
    "model checkpoint lora_rank lora_alpha lora_dropout seed nf4_head pack dora".split()
)
TRAINING_STATE = "training_state.safetensors"
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's, by torch's names


def _moment(optimizer, key, p):
    """AdamW's moment `key` of parameter p; zeros for one that was never stepped."""
    return optimizer.state[p].get(key, torch.zeros_like(p))


def save_checkpoint(out_dir, step, fsdp, optimizer, peft, flags):
    """Collective. Rank 0 writes out_dir/checkpoint-<step>/ (the adapters, and
    training_state.safetensors: AdamW's full moments, "exp_avg/<name>", and in its metadata the
    step, AdamW's counts, the world size and `flags`, what --resume must match) under a
    temporary name, renamed, then points out_dir/latest at it: a crash leaves the previous one
    whole. No RNG state: each step seeds its dropout. The adapters also go in out_dir, for PEFT."""
    adapters = fsdp.full_adapters()
    latest = os.path.join(out_dir, "latest")
    kept = "; its last checkpoint is intact" if os.path.isfile(latest) else ""
    finite = all(t.isfinite().all() for t in adapters.values())
    require(
        finite, f"--out {out_dir}: the adapters hold inf or NaN after step {step}, not saved{kept}"
    )
    moments = {}
    for key in MOMENTS:
        full = fsdp.full_adapters(of=functools.partial(_moment, optimizer, key))
        moments.update({f"{key}/{name}": t for name, t in full.items()})
    # A parameter that never had a gradient has no state: step 0.
    adam_steps = {n: int(optimizer.state[p].get("step", 0)) for n, p in fsdp.named_parameters()}
    world, rank = world_and_rank()
    if rank == 0:
        name = f"checkpoint-{step}"
        final = os.path.join(out_dir, name)
        tmp = os.path.join(out_dir, f".{name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_adapters(tmp, adapters, peft)
        state = dict(step=step, adam_steps=adam_steps, world_size=world, flags=flags)
        specs = [(n, torch.float32, tuple(t.shape)) for n, t in moments.items()]
        metadata = {"training_state": json.dumps(state)}
        save_safetensors(os.path.join(tmp, TRAINING_STATE), specs, moments.__getitem__, metadata)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        atomic_write(latest, lambda f: f.write(name), "w")
        for old in os.listdir(out_dir):  # keep only the newest checkpoint
            if old.startswith("checkpoint-") and old != name:
                shutil.rmtree(os.path.join(out_dir, old), ignore_errors=True)
        save_adapters(out_dir, adapters, peft)
    if dist.is_initialized():
        dist.barrier()


def read_training_state(out_dir, flags, shapes):
    """The checkpoint that out_dir/latest names, read and checked before anything is built: its
    flags against `flags` (this run's values of RESUME_MUST_MATCH), its adapters and AdamW
    moments against `shapes` (the model's adapters). -> (its directory, its training state,
    its adapters, its moments' SafetensorsFile)."""
    latest = os.path.join(out_dir, "latest")
    require(os.path.isfile(latest), f"--resume: no checkpoint to resume from in --out {out_dir}")
    with open(latest) as f:
        checkpoint_dir = os.path.join(out_dir, f.read().strip())
    path = os.path.join(checkpoint_dir, TRAINING_STATE)
    older = os.path.join(checkpoint_dir, "training_state.pt")
    require(
        os.path.isfile(path) or not os.path.isfile(older),
        f"{older}: saved by an older version of this file; resume it with that version",
    )
    sf = SafetensorsFile(path)
    raw = sf.metadata.get("training_state", "")
    state = read_json(path, raw.encode() if isinstance(raw, str) else b"", "its training_state")
    saved = state.get("flags")
    require(isinstance(saved, dict), f"{path}: not a training state (no flags)")
    for key, mine in flags.items():
        require(
            saved.get(key) == mine,
            f"--resume {checkpoint_dir}: saved with --{key} {saved.get(key)}, this run has "
            f"--{key} {mine}",
        )
    adapters = load_adapters(checkpoint_dir)
    steps = state.get("adam_steps")
    moments = {f"{key}/{name}": shape for key in MOMENTS for name, shape in shapes.items()}
    ok = {n: tuple(t.shape) for n, t in adapters.items()} == shapes
    ok = ok and {n: tuple(e.shape) for n, e in sf.entries.items()} == moments
    ok = ok and isinstance(steps, dict) and steps.keys() == shapes.keys()
    require(
        ok and _is_count(state.get("step")),
        f"--resume {checkpoint_dir}: its adapters or AdamW moments are not this "
        f"model's (an older format?)",
    )
    return checkpoint_dir, state, adapters, sf


def resume(saved, fsdp, optimizer):
    """Load a checkpoint that read_training_state read into the shards and AdamW; -> its step."""
    checkpoint_dir, state, adapters, sf = saved
    steps = state["adam_steps"]
    for name, t in adapters.items():
        fsdp.load_full(name, t)
    for name, p in fsdp.named_parameters():
        if not steps[name]:
            continue  # a parameter never stepped has no state yet
        zeros = torch.zeros_like(p)
        optimizer.state[p] = dict(step=int(steps[name]), exp_avg=zeros, exp_avg_sq=zeros.clone())
        for key in MOMENTS:
            moment = functools.partial(_moment, optimizer, key)
            fsdp.load_full(name, sf.get(f"{key}/{name}"), of=moment)
    world = state.get("world_size")
    print0(f"resumed from {checkpoint_dir} at step {state['step']} (saved by world size {world})")
    return state["step"]


def shard_files(specs, max_bytes):
    """{file name: [(name, dtype, shape)]}, cut and named as save_pretrained(max_shard_size) does:
    a new file where the next tensor would pass max_bytes. Our order is kept (readers use the
    index)."""
    files = [[]]
    size = 0
    for spec in specs:
        n = math.prod(spec[2]) * spec[1].itemsize
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(spec)
        size += n
    n = len(files)
    if n == 1:
        return {"model.safetensors": files[0]}
    return {f"model-{i:05d}-of-{n:05d}.safetensors": f for i, f in enumerate(files, 1)}


def _merged_config(model, source):
    """config.json of a merged export: the source checkpoint's other keys, its token ids, kept."""
    kept = read_json(os.path.join(source, "config.json")) if source else {}
    for key in ("dtype", "quantization_config"):
        kept.pop(key, None)
    config = {**kept, **config_to_hf(model.config, model.dtype)}
    config["tie_word_embeddings"] = False  # the head is written
    return config


# A merged export stands alone: the source checkpoint's tokenizer and chat template beside it.
BESIDE_THE_WEIGHTS = (
    "generation_config.json tokenizer.json tokenizer_config.json special_tokens_map.json "
    "chat_template.jinja tokenizer.model vocab.json merges.txt added_tokens.json"
).split()
MERGED = "merged by qlora_fsdp"  # in a merged export's metadata: NF4 again would lose the tuning


def save_merged(out_dir, fsdp, model, source=None, max_shard_bytes=5e9):
    """Collective. Rank 0 writes the base with the adapters merged, W + (alpha/rank) B A (with
    DoRA, dora_merge's), unit by unit, as Hugging Face does (sharded files and an index above
    max_shard_bytes), config.json (the `source`'s other keys kept), and the source's tokenizer,
    chat template and generation_config.json."""
    adapters = fsdp.full_adapters()
    base = fsdp.full_base()  # (name, full tensor), unit by unit, in param_of's order

    def get(name):
        got, w = next(base)
        assert got == name, (got, name)
        w = w.to(torch.float32)  # an NF4 weight dequantizes
        prefix = name.removesuffix(".weight")
        if prefix + ".lora_A" in adapters:
            scaling = model.get_submodule(prefix).scaling
            delta = adapters[prefix + ".lora_B"] @ adapters[prefix + ".lora_A"]
            w = w + scaling * delta.to(w.device)
        magnitude = adapters.get(prefix + ".lora_magnitude_vector")
        if magnitude is not None:
            w = dora_merge(w, magnitude.to(w.device))
        return w.to(model.dtype)

    if world_and_rank()[1] == 0:
        os.makedirs(out_dir, exist_ok=True)
        frozen = [(fqn, p.shape) for fqn, (_, p) in fsdp.param_of.items() if not p.trainable]
        specs = [(name, model.dtype, shape) for name, shape in frozen]
        files = shard_files(specs, max_shard_bytes)
        for name, file_specs in files.items():
            save_safetensors(os.path.join(out_dir, name), file_specs, get, {MERGED: "yes"})
        if len(files) > 1:
            # After the shards: a reader that finds the index finds every file it names.
            total = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in specs)
            weight_map = {n: name for name, f in files.items() for n, _, _ in f}
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)
        write_json(os.path.join(out_dir, "config.json"), _merged_config(model, source))
        for name in BESIDE_THE_WEIGHTS if source else ():
            if os.path.isfile(os.path.join(source, name)):
                with open(os.path.join(source, name), "rb") as src:
                    copy = os.path.join(out_dir, name)
                    atomic_write(copy, lambda f: shutil.copyfileobj(src, f))
    # The other ranks join the same all-gathers; every rank frees the last unit.
    for _ in base:
        pass
    if dist.is_initialized():
        dist.barrier()


# -----------------------------------------------------------------------------
# 15. Your data: files of ids, text, JSONL and chats, rows of documents, prompts
# -----------------------------------------------------------------------------
# Needs: import bisect, datetime, hashlib, json, os, re, time, numpy as np, torch; from
# typing import NamedTuple, Optional; from above: UserError, require, read_json, atomic_write,
# get_batch, Batch, IGNORE_INDEX, PROGRESS_S, seeded.
#
# With --checkpoint, a data file is plain text (one example: the whole file) or .jsonl, one
# example a line, as TRL's SFTTrainer, torchtune and axolotl take them:
#   {"text": "..."}                                  every token counts
#   {"prompt": "...", "completion": "..."}           the completion and its EOS count
#   {"messages": [{"role": ..., "content": ...}]}    the assistant turns count
# The checkpoint's tokenizer.json runs in the `tokenizers` library (its own threads) and its
# chat template in jinja2, as transformers runs them: the ids are PreTrainedTokenizerFast's and
# apply_chat_template's. A file is tokenized once: the result is cached under a hash of the
# file and the tokenizer (--tokenize_to writes it where you say).


def _json_if_any(path):
    """The JSON object in path; {} where there is no such file."""
    return read_json(path) if os.path.isfile(path) else {}


# The special tokens transformers hands a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKENS = "bos_token eos_token unk_token sep_token pad_token cls_token mask_token".split()
# The checkpoint's files that decide what a data file tokenizes to: they key the cache.
TOKENIZER_FILES = (
    "tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja "
    "config.json generation_config.json"
).split()
CACHE_VERSION = 1  # bump when a rule below changes what a file tokenizes to
TOKENIZE_BATCH = 1024  # examples per encode_batch call: enough to keep its threads busy
PIECE = 1 << 20  # characters: a longer text is encoded in pieces of about this size


# Chat templates, rendered as transformers renders them (utils/chat_template_utils.py)


def _compile(template):
    """The template in transformers' jinja2 sandbox, with its tojson filter and globals."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise UserError("chat templates need jinja2: pip install jinja2") from None

    class Generation(jinja2.ext.Extension):
        """{% generation %} marks replies for transformers' own masks; here it renders as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson escapes non-ASCII and HTML characters; transformers' does not.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def _read_chat_template(checkpoint_dir, config):
    """(template or None, its file): chat_template.jinja (transformers 5), else the config's."""
    path = os.path.join(checkpoint_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    path = os.path.join(checkpoint_dir, "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        require("default" in named, f"{path}: chat_template is a list with no 'default'")
        template = named["default"]
    require(template is None or isinstance(template, str), f"{path}: chat_template is no string")
    return template, path


# The tokenizer: tokenizer.json, the special tokens, the chat template

LINE_START = re.compile(r"\n(?=\S)")  # a newline before a line's first visible character


def _prefix(backend):
    """The ids the post-processor puts before a text (a BOS, or none); None where it puts some
    after, or where a text's start changes its ids (a prefix space): then no pieces."""
    bare = backend.encode("foo\nbar", add_special_tokens=False).ids
    parts = backend.encode("foo\n", add_special_tokens=False).ids
    parts += backend.encode("bar", add_special_tokens=False).ids
    full = backend.encode("foo\nbar", add_special_tokens=True).ids
    head = len(full) - len(bare)
    if backend.pre_tokenizer is None or parts != bare or full[head:] != bare:
        return None
    return full[:head]


def _pieces(backend, text):
    """The text cut about every PIECE characters where a pre-token ends (BPE merges only
    within one, so the pieces encode to the text's ids): after a newline before a visible
    character, where the pre-tokenizer splits the characters around alike apart or together."""
    split = backend.pre_tokenizer.pre_tokenize_str
    pieces = []
    start = 0
    at = PIECE
    while len(text) - start > 2 * PIECE:
        match = LINE_START.search(text, at)
        if match is None:
            break
        at = match.end()
        apart = split(text[max(0, at - 100) : at]) + split(text[at : at + 100])
        together = split(text[max(0, at - 100) : at + 100])
        if [s for s, _ in apart] == [s for s, _ in together]:
            pieces.append(text[start:at])
            start = at
            at += PIECE
    pieces.append(text[start:])
    return pieces


def eos_ids(checkpoint_dir, *names):
    """The eos_token_id (one id or a list) of the first of the checkpoint's files `names` that
    has one: how every reader here finds a text's end token (the tokenizer's examples, --pack's
    documents, the stops of a sample), each asking the files its reference reads."""
    for name in names:
        ids = _json_if_any(os.path.join(checkpoint_dir, name)).get("eos_token_id")
        if ids is not None:
            return [i for i in (ids if isinstance(ids, list) else [ids]) if type(i) is int]
    return []


class Tokenizer:
    """A checkpoint's tokenizer.json run as it is, with PreTrainedTokenizerFast's ids: its
    post-processor adds BOS where the model wants one, and tokenizer_config.json's add_bos_token
    is ignored, as transformers 5 ignores it when a tokenizer.json exists."""

    def __init__(self, backend, plain, special_tokens, end_ids, chat_template):
        self.backend = backend  # a tokenizers.Tokenizer
        self.plain = plain  # the same without its post-processor, for chats (see load)
        self.prefix = _prefix(backend)  # what the post-processor puts before a text (BOS)
        self.special_tokens = special_tokens  # {"bos_token": "<s>", ...}: template variables
        self.end_ids = end_ids  # the ids that end a turn: the EOS, config.json's eos_token_id
        self.eos_id = end_ids[0] if end_ids else None  # ends each example (None: none named)
        self.chat_template = chat_template  # compiled (a jinja2 Template), or None

    @classmethod
    def load(cls, checkpoint_dir):
        """The checkpoint's Tokenizer; None where it has no tokenizer.json."""
        path = os.path.join(checkpoint_dir, "tokenizer.json")
        if not os.path.isfile(path):
            return None
        try:
            import tokenizers
        except ImportError:
            raise UserError(
                f"{path}: text needs the tokenizers package (pip install tokenizers), "
                f"or pass token ids as .npy"
            ) from None
        try:
            backend = tokenizers.Tokenizer.from_file(path)
            plain = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 -- the library raises plain Exceptions
            raise UserError(f"{path}: cannot be read by tokenizers ({e})") from None
        # Without special tokens a post-processor adds no ids, but it can trim spaces off the
        # offsets (ByteLevel's trim_offsets, GPT-2's default): chats need the true ones.
        plain.post_processor = None
        config = _json_if_any(os.path.join(checkpoint_dir, "tokenizer_config.json"))
        # Older checkpoints name some special tokens in special_tokens_map.json alone.
        legacy = _json_if_any(os.path.join(checkpoint_dir, "special_tokens_map.json"))
        special_tokens = {}
        for name in SPECIAL_TOKENS:
            token = config.get(name) or legacy.get(name)
            if isinstance(token, dict):  # {"__type": "AddedToken", "content": "<s>", ...}
                token = token.get("content")
            if isinstance(token, str):
                special_tokens[name] = token
        # EOS: the tokenizer's, else config.json's (or generation_config.json's) first.
        eos_id = backend.token_to_id(special_tokens.get("eos_token", ""))
        end_ids = [eos_id] if isinstance(eos_id, int) else []
        end_ids += eos_ids(checkpoint_dir, "config.json")
        end_ids += eos_ids(checkpoint_dir, "generation_config.json")
        template, where = _read_chat_template(checkpoint_dir, config)
        if template is not None:
            try:
                template = _compile(template)  # compiled once, here, so that errors name the file
            except Exception as e:  # noqa: BLE001 -- TemplateSyntaxError and kin
                line = getattr(e, "lineno", None)
                message = f"{where}: the chat template does not compile (line {line}: {e})"
                raise UserError(message) from None
        return cls(backend, plain, special_tokens, end_ids, template)

    def encode_batch(self, texts, add_special_tokens):
        """The ids of each text, encoded on the library's threads (TOKENIZERS_PARALLELISM)."""
        # encode_batch_fast (tokenizers >= 0.21) skips the offsets, which only chats need.
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]

    def encode_texts(self, texts):
        """encode_batch(texts, True)'s ids, a long text in pieces on all threads (one encoding
        holds ~400 bytes a token, on one thread), unless pieces could change its ids."""
        if self.prefix is None:
            return self.encode_batch(texts, True)
        pieces = [_pieces(self.backend, text) for text in texts]
        encoded = iter(self.encode_batch([p for text in pieces for p in text], False))
        out = []
        for text in pieces:
            ids = list(self.prefix)
            for _ in text:
                ids += next(encoded)
            out.append(ids)
        return out

    def decode(self, ids):
        """The text of ids with the special tokens in it: what the model sees."""
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def encode_chat(self, messages, where="the chat"):
        """The ids of a chat up to the assistant's turn: apply_chat_template(messages,
        add_generation_prompt=True, tokenize=True)'s (its template writes any BOS)."""
        text = self.render(messages, True, where)
        return self.plain.encode_batch([text], add_special_tokens=False)[0].ids

    def render(self, messages, add_generation_prompt, where="the chat"):
        """The chat as apply_chat_template(tokenize=False) writes it."""
        require(self.chat_template is not None, f"{where}: the checkpoint has no chat template")
        # transformers drops the keys whose value is None (a content: null beside tool_calls).
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self.chat_template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except Exception as e:  # noqa: BLE001 -- raise_exception's TemplateError, UndefinedError
            message = " ".join(str(e).split())
            raise UserError(f"{where}: the chat template fails: {message}") from None


# Examples: reading a data file


class Example(NamedTuple):
    """One example: text, or prompt and completion, or messages."""

    where: str  # "path:line", for error messages
    text: Optional[str] = None
    prompt: Optional[str] = None
    completion: Optional[str] = None
    messages: Optional[list] = None


def _example(obj, where, to_learn=True):
    """The Example in one .jsonl line's JSON value, checked (to_learn: a chat has a reply)."""
    require(isinstance(obj, dict), f"{where}: not a JSON object")
    keys = [k for k in ("text", "prompt", "completion", "messages") if k in obj]
    require(
        keys in (["text"], ["prompt", "completion"], ["messages"]),
        f"{where}: needs text, prompt + completion, or messages (has {', '.join(keys) or 'none'})",
    )
    if keys != ["messages"]:
        for key in keys:
            require(isinstance(obj[key], str), f"{where}: '{key}' is not a string")
        return Example(where, **{key: obj[key] for key in keys})
    messages = obj["messages"]
    require(isinstance(messages, list) and messages, f"{where}: 'messages' is no list of turns")
    for i, m in enumerate(messages):
        for key in ("role", "content"):
            ok = isinstance(m, dict) and isinstance(m.get(key), str)
            require(ok, f"{where}: messages[{i}] has no '{key}' string")
    roles = [m["role"] for m in messages]
    has_reply = "assistant" in roles or not to_learn
    require(has_reply, f"{where}: the chat has no assistant turn to learn from")
    return Example(where, messages=messages)


def read_examples(path, to_learn=True):
    """The examples in a data file: .jsonl one a line, any other file one (its whole text).
    to_learn: each chat has a reply to learn (a file of prompts need not)."""
    require(os.path.isfile(path), f"{path}: no such file")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x})") from None
    text = text.removeprefix("\ufeff")  # a byte-order mark is no part of the data
    require(text.strip(), f"{path}: the file is empty")
    if not path.lower().endswith(".jsonl"):
        return [Example(path, text=text)]
    examples = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        examples.append(_example(obj, where, to_learn))
    return examples


# Tokenizing: the ids, and which of them are targets


class TokenData(NamedTuple):
    """Tokens as one stream: ids (N,) of any integer dtype; loss_mask (N,) bool or None, true
    where the prediction of token i counts (token 0 is never a target); starts (E,) or None,
    where each example begins (it ends where the next begins)."""

    ids: np.ndarray
    loss_mask: Optional[np.ndarray]
    starts: Optional[np.ndarray] = None

    def batch(self, step, micro, plan, world, rank):
        """get_batch's windows of the ids; with a loss mask, the same windows of it mask the
        targets (the same draws pick them)."""
        inputs, targets, _ = get_batch(self.ids, step, micro, plan, world, rank, None)
        if self.loss_mask is None:
            return Batch(inputs, targets)
        _, counted, _ = get_batch(self.loss_mask, step, micro, plan, world, rank, None)
        return Batch(inputs, targets.masked_fill(~counted.bool(), IGNORE_INDEX))

    def rows(self, indices, seq_len):
        """The Batch of windows `indices`: window i is tokens [i T, i T + T + 1) (None: window 0,
        counting nothing): --val_data's rows."""
        T = seq_len
        windows = [self.ids[(i or 0) * T : (i or 0) * T + T + 1] for i in indices]
        tokens = torch.from_numpy(np.stack(windows).astype(np.int64))  # (n, T + 1)
        targets = tokens[:, 1:].clone()
        for r, i in enumerate(indices):
            if i is None:
                targets[r] = IGNORE_INDEX
            elif self.loss_mask is not None:
                counted = torch.from_numpy(self.loss_mask[i * T + 1 : i * T + T + 1])
                targets[r].masked_fill_(~counted, IGNORE_INDEX)
        return Batch(tokens[:, :-1], targets)

    def row_count(self, seq_len):
        """The windows of T + 1 tokens, each starting where the one before ends."""
        return (len(self.ids) - 1) // seq_len


def _reply_mask(tokenizer, example, chat, offsets):
    """(n,) bool: the chat's tokens that hold characters of a reply or the end of its turn:
    those between messages[:i] rendered with the generation prompt and messages[:i+1] without.
    They map onto the whole chat's tokens through the offsets; a prefix tokenized alone would
    not do, for BPE merges across its end (ChatML's "assistant\\n" with a reply's "\\n\\n").
    A token across a border holds some of the reply: it counts, as transformers counts it."""
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(offsets), dtype=bool)
    for i, m in enumerate(example.messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.render(example.messages[:i], True, example.where)
        after = tokenizer.render(example.messages[: i + 1], False, example.where)
        require(
            after.startswith(before) and chat.startswith(after),
            f"{example.where}: the chat template writes messages[:{i + 1}] differently inside "
            f"the whole chat, so the reply's tokens cannot be found; give each reply a line",
        )
        mask |= (offsets[:, 0] < len(after)) & (offsets[:, 1] > len(before))
    return mask


def _tokenize_batch(examples, tokenizer):
    """[(ids, mask)] for each example, in order."""
    eos = tokenizer.eos_id
    out = [None] * len(examples)
    # text: BOS where the post-processor adds one, the text, EOS; every token counts.
    index = [i for i, e in enumerate(examples) if e.text is not None]
    texts = tokenizer.encode_texts([examples[i].text for i in index])
    for i, ids in zip(index, texts):
        if not ids or ids[-1] != eos:
            ids.append(eos)
        out[i] = (ids, np.ones(len(ids), dtype=bool))
    # prompt/completion: each tokenized alone, the prompt as at inference; the completion and
    # its EOS count. TRL 1.x tokenizes prompt + completion + EOS as one string: the same ids
    # unless a token merges across the border.
    index = [i for i, e in enumerate(examples) if e.prompt is not None]
    prompts = tokenizer.encode_batch([examples[i].prompt for i in index], True)
    completions = tokenizer.encode_batch([examples[i].completion for i in index], False)
    for i, prompt, completion in zip(index, prompts, completions):
        mask = [False] * len(prompt) + [True] * (len(completion) + 1)
        out[i] = (prompt + completion + [eos], np.array(mask))
    # messages: the rendered chat without special tokens, as apply_chat_template(tokenize=True)
    # encodes it: its template writes the BOS (Llama 3's {{ bos_token }}), never doubled.
    index = [i for i, e in enumerate(examples) if e.messages is not None]
    chats = [tokenizer.render(examples[i].messages, False, examples[i].where) for i in index]
    encodings = tokenizer.plain.encode_batch(chats, add_special_tokens=False)
    ends = [tokenizer.backend.id_to_token(i) for i in tokenizer.end_ids]
    for i, chat, encoding in zip(index, chats, encodings):
        ids = encoding.ids
        mask = _reply_mask(tokenizer, examples[i], chat, encoding.offsets)
        # Each example ends with EOS, unless its template already ended the turn with one
        # (trailing whitespace aside). ChatML ends a turn with "<|im_end|>\n": where that is
        # the EOS (Qwen2.5, SmolLM2 Instruct) another after the "\n" would teach a turn that
        # never comes; where the EOS is another token (a base model's <|endoftext|>) it follows.
        if not any(chat.rstrip().endswith(end) for end in ends if end):
            ids.append(eos)
            # After a reply the EOS is a target: the model learns to stop there.
            mask = np.append(mask, examples[i].messages[-1]["role"] == "assistant")
        out[i] = (ids, mask)
    return out


def tokenize(examples, tokenizer, say=None):
    """TokenData of the examples, in order; say(line) hears progress every ~10 s."""
    require(examples, "no examples to tokenize")
    require(
        tokenizer.eos_id is not None,
        "the checkpoint names no EOS token to end examples with (tokenizer_config.json's "
        "eos_token, config.json's eos_token_id)",
    )
    vocab_size = tokenizer.backend.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    tokens = []
    masks = []
    chars = 0  # of the examples' own text, for the progress lines
    started = time.monotonic()
    said = started
    for b in range(0, len(examples), TOKENIZE_BATCH):
        batch = examples[b : b + TOKENIZE_BATCH]
        for ids, mask in _tokenize_batch(batch, tokenizer):
            tokens.append(np.array(ids, dtype=dtype))
            masks.append(mask)
        for e in batch:
            chars += len(e.text or "") + len(e.prompt or "") + len(e.completion or "")
            chars += sum(len(m["content"]) for m in e.messages or [])
        now = time.monotonic()
        if say and now - said >= PROGRESS_S:
            said = now
            rate = chars / 1e6 / (now - started)
            say(f"tokenized {b + len(batch):,}/{len(examples):,} examples, {rate:.1f} MB/s")
    starts = np.cumsum([0] + [len(t) for t in tokens[:-1]], dtype=np.int64)
    return TokenData(np.concatenate(tokens), np.concatenate(masks), starts)


# A data file, tokenized once: the cache


def _cache_key(path, tokenizer_dir):
    """A hash of the data file, the tokenizer's files and the versions of these rules."""
    import tokenizers

    h = hashlib.sha256(f"yourdata {CACHE_VERSION} tokenizers {tokenizers.__version__}".encode())
    files = [path] + [os.path.join(tokenizer_dir, name) for name in TOKENIZER_FILES]
    for i, file in enumerate(files):
        if not os.path.isfile(file):
            continue
        h.update(f"\0file {i}\0".encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()[:20]


def tokenize_file(path, tokenizer_dir, cache_dir, say=None):
    """TokenData of a data file under a checkpoint's tokenizer, cached in cache_dir under a hash
    of the data and the tokenizer's files: a second call only loads the arrays."""
    require(os.path.isfile(path), f"{path}: no such file")
    tokenizer = Tokenizer.load(tokenizer_dir)
    require(tokenizer, f"{tokenizer_dir}: no tokenizer.json to read {path}; pass ids as .npy")
    key = _cache_key(path, tokenizer_dir)
    cache = os.path.join(cache_dir, f"{os.path.basename(path)}.{key}.npz")
    if os.path.isfile(cache):
        with np.load(cache, allow_pickle=False) as z:
            return TokenData(z["tokens"], z["loss_mask"], z["starts"])
    started = time.monotonic()
    examples = read_examples(path)
    data = tokenize(examples, tokenizer, say)
    seconds = time.monotonic() - started
    if say:
        mb = os.path.getsize(path) / 1e6
        targets = int(data.loss_mask.sum())
        say(
            f"{path}: {len(examples):,} examples, {len(data.ids):,} tokens ({targets:,} "
            f"targets) in {seconds:.1f} s, {mb / seconds:.1f} MB/s"
        )
    # Processes racing to fill the cache each rename a whole file into place.
    os.makedirs(cache_dir, exist_ok=True)
    arrays = dict(tokens=data.ids, loss_mask=data.loss_mask, starts=data.starts)
    atomic_write(cache, lambda f: np.savez(f, **arrays))
    return data


# A data file of ids, and rows of documents


def is_text(path):
    """Whether a data file is text (not .npy, .npz or .bin ids): bytes, or tokenized."""
    return os.path.splitext(path)[1].lower() not in (".npy", ".npz", ".bin")


def _read_token_file(path, ext, where):
    """TokenData's arrays, unchecked; .npy, .bin and .txt are memory-mapped."""
    try:
        if ext == ".npz":
            with np.load(path, allow_pickle=False) as z:
                starts = z["starts"] if "starts" in z.files else None
                return TokenData(z["tokens"], z["loss_mask"], starts)
        if ext == ".npy":
            return TokenData(np.load(path, mmap_mode="r", allow_pickle=False), None)
        dtype = np.uint16 if ext == ".bin" else np.uint8
        return TokenData(np.memmap(path, dtype=dtype, mode="r"), None)
    except Exception as e:  # noqa: BLE001 -- not an array file, truncated, pickled, odd size...
        # numpy's messages run to several sentences: the first.
        why = " ".join(str(e).split()).split(". ")[0]
        raise UserError(f"{where}: cannot be read as {ext} ({type(e).__name__}: {why})") from None


def check_ids(ids, vocab_size, where):
    """Refuse ids outside [0, vocab_size) (a file's, or what a tokenizer made)."""
    hi = int(ids.max())
    require(hi < vocab_size, f"{where}: token id {hi} >= vocab_size {vocab_size} of this model")
    if np.issubdtype(ids.dtype, np.signedinteger):  # a pass fewer if unsigned
        lo = int(ids.min())
        require(lo >= 0, f"{where}: negative token id {lo}")


def load_tokens(path, vocab_size, flag="--data"):
    """TokenData from a --data (or --val_data) file of ids (formats: see --help), checked: a
    1-D integer array, every id below vocab_size, a loss mask and example starts that fit."""
    where = f"{flag} {path}"
    require(os.path.isfile(path), f"{where}: no such file")
    # Text (anything but .npy, .npz and .bin) is raw bytes, one token each.
    ext = ".txt" if is_text(path) else os.path.splitext(path)[1].lower()
    require(
        ext != ".bin" or vocab_size <= 65536,
        f"{where}: a .bin holds uint16 ids, too few for this model's {vocab_size:,}-token "
        f"vocabulary; save the tokens as .npy (uint32)",
    )
    tokens, mask, starts = _read_token_file(path, ext, where)
    require(
        tokens.ndim == 1 and np.issubdtype(tokens.dtype, np.integer),
        f"{where}: tokens must be a 1-D integer array, not {tokens.ndim}-D {tokens.dtype}",
    )
    require(len(tokens), f"{where}: no tokens")
    check_ids(tokens, vocab_size, where)
    if mask is not None:
        require(
            mask.shape == tokens.shape,
            f"{where}: loss_mask has shape {mask.shape}, tokens {tokens.shape}",
        )
        require(np.isin(mask, (0, 1)).all(), f"{where}: loss_mask holds values other than 0 and 1")
        require(
            mask[1:].any(),
            f"{where}: loss_mask counts no target (0 at every position after the first)",
        )
        mask = mask.astype(bool)  # token 0 is never a target: mask[0] is not used
    if starts is not None:
        ok = starts.ndim == 1 and len(starts) and starts[0] == 0 and (np.diff(starts) > 0).all()
        ok = ok and starts[-1] < len(tokens)
        require(ok, f"{where}: starts must rise from 0 within the tokens (where examples begin)")
    return TokenData(tokens, mask, starts)


def document_spans(data, eos_id, seq_len):
    """(starts, lengths) of a stream's documents: its examples (data.starts), or ending with an
    EOS; one longer than seq_len is cut into pieces of seq_len, each a document of its own."""
    ends = np.flatnonzero(np.asarray(data.ids) == eos_id) + 1
    if data.starts is not None:
        ends = data.starts
    bounds = np.unique(np.concatenate([[0], ends, [len(data.ids)]]))
    starts = []
    lengths = []
    for begin, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        for start in range(begin, end, seq_len):
            starts.append(start)
            lengths.append(min(seq_len, end - start))
    return np.array(starts), np.array(lengths)


class PackedDocuments:
    """Rows of seq_len tokens filled with whole documents (--pack; per_row=1: examples one a
    row), in an order drawn per epoch from the seed, or the file's; padding counts nothing.
    A document of n tokens gives n - 1 targets; row i depends only on the seed, so a step's
    rows are get_batch's: the same at any split and after --resume. One document a row starts
    at position 0 and the padding after it counts nothing: plain causal attention (the fused
    kernel) then equals the document alone, and its rows carry no positions."""

    def __init__(self, data, eos_id, seq_len, seed, shuffle=True, per_row=None):
        self.data = data
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.per_row = per_row or seq_len  # documents per row at most (1: examples unpacked)
        self.starts, self.lengths = document_spans(data, eos_id, seq_len)
        self.epochs = []  # the rows of each epoch packed so far: lists of document indices
        self.first_row = [0]  # the index of each epoch's first row, and of the next epoch's

    def _pack(self, epoch):
        order = np.arange(len(self.lengths))
        if self.shuffle:
            order = torch.randperm(len(order), generator=seeded(self.seed, "pack", epoch)).numpy()
        rows = [[]]
        used = 0
        for i in order.tolist():
            if used + self.lengths[i] > self.seq_len or len(rows[-1]) == self.per_row:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += self.lengths[i]
        return rows

    def row(self, index):
        """Row `index` (a list of document indices), packing epochs as they are reached."""
        while index >= self.first_row[-1]:
            rows = self._pack(len(self.epochs))
            self.epochs.append(rows)
            self.first_row.append(self.first_row[-1] + len(rows))
        epoch = bisect.bisect_right(self.first_row, index) - 1
        return self.epochs[epoch][index - self.first_row[epoch]]

    def tensors(self, rows):
        """The Batch of these rows: inputs, targets and positions, from 0 in each document (the
        padding after the last: a document counting nothing)."""
        shape = (len(rows), self.seq_len)
        inputs = np.zeros(shape, dtype=np.int64)
        targets = np.full(shape, IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros(shape, dtype=np.int64)
        mask = self.data.loss_mask
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                start = self.starts[i]
                n = self.lengths[i]
                inputs[r, at : at + n] = self.data.ids[start : start + n]
                following = self.data.ids[start + 1 : start + n].astype(np.int64)  # n - 1 next
                if mask is not None:
                    following = np.where(mask[start + 1 : start + n], following, IGNORE_INDEX)
                targets[r, at : at + n - 1] = following
                positions[r, at : at + n] = np.arange(n)
                at += n
            positions[r, at:] = np.arange(self.seq_len - at)
        tensors = [torch.from_numpy(a) for a in (inputs, targets, positions)]
        if self.per_row == 1:
            tensors[2] = None  # 0, 1, ... in each row: causal, as for no positions
        return Batch(*tensors)

    def rows(self, indices, seq_len):
        """The Batch of rows `indices` of the first epoch, in the file's order (None: a row
        counting nothing), each of its own seq_len: --val_data's rows."""
        return self.tensors([[] if i is None else self.row(i) for i in indices])

    def row_count(self, seq_len):
        """The rows of the first epoch: each document once."""
        self.row(0)  # packs the first epoch
        return self.first_row[1]

    def batch(self, step, micro, plan, world, rank):
        """This rank's Batch of micro-batch `micro` of `step`, in get_batch's order (plan: its
        batch_size and grad_accum)."""
        n = plan.batch_size * plan.grad_accum * world
        first = step * n + (micro * world + rank) * plan.batch_size
        return self.tensors([self.row(i) for i in range(first, first + plan.batch_size)])


# Prompts: what a sample continues


def encode_prompt(text, vocab_size, tokenizer=None):
    """--prompt as token ids: comma-separated ids, else text: tokenized by the checkpoint's
    tokenizer, or for a byte-level model its UTF-8 bytes (by default a newline)."""
    ids_given = re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*,?\s*", text or "")
    if tokenizer is not None and not ids_given:
        ids = tokenizer.encode_batch([text or "\n"], True)[0]
        require(bool(ids), f"--prompt {text!r}: no tokens")
        return ids
    try:
        if vocab_size == 256 and not ids_given:  # byte-level
            want = "non-empty text (its UTF-8 bytes are the tokens)"
            ids = list(("\n" if text is None else text).encode("utf-8"))
        else:
            want = f"comma-separated token ids below {vocab_size}, e.g. 128000,791"
            ids = [int(t) for t in (text or "").split(",") if t.strip()]
    except ValueError:  # not numbers, or text that is not UTF-8
        ids = []
    valid = bool(ids) and all(0 <= i < vocab_size for i in ids)
    require(valid, f"--prompt {text!r}: this model's prompt is {want}")
    return ids


class Prompt(NamedTuple):
    """What a sample continues: its ids; for a chat, its messages (and the reply a
    --prompt_file line held, kept beside the model's)."""

    ids: list
    messages: Optional[list] = None
    reference: Optional[str] = None


def read_prompts(prompt, prompt_file, chat, vocab_size, tokenizer):
    """--sample's prompts: the prompt (with chat, one user turn in the chat template), or each
    chat of the prompt_file (a last assistant turn held out as the reference)."""
    if not (chat or prompt_file):
        return [Prompt(encode_prompt(prompt, vocab_size, tokenizer))]
    flag = "--prompt_file" if prompt_file else "--chat"
    has_template = tokenizer is not None and tokenizer.chat_template is not None
    require(has_template, f"{flag}: the checkpoint has no chat template")
    if not prompt_file:
        messages = [{"role": "user", "content": prompt}]
        return [Prompt(tokenizer.encode_chat(messages, "--chat"), messages)]
    prompts = []
    for e in read_examples(prompt_file, to_learn=False):
        require(e.messages is not None, f'{e.where}: --prompt_file takes {{"messages": [...]}}')
        messages = e.messages
        reference = None
        if messages[-1]["role"] == "assistant":
            reference = messages[-1]["content"]
            messages = messages[:-1]
        require(messages, f"{e.where}: no turn before the assistant's")
        prompts.append(Prompt(tokenizer.encode_chat(messages, e.where), messages, reference))
    return prompts


def stop_ids(checkpoint, eos_id=None):
    """The ids that end a sample, as transformers' generate reads them: the checkpoint's
    generation_config.json's eos_token_id (one id or a list), else config.json's; and eos_id."""
    files = ("generation_config.json", "config.json")
    ids = eos_ids(checkpoint, *files) if checkpoint else []
    return ids + ([] if eos_id is None else [eos_id])


# -----------------------------------------------------------------------------
# 16. A run: set up from the flags, the loop over steps, the end
# -----------------------------------------------------------------------------
# Needs: import contextlib, dataclasses, functools, json, math, os, resource, shlex, signal,
# sys, tempfile, threading, time, numpy as np, torch, torch.distributed as dist; from
# torch.distributed.device_mesh import init_device_mesh; from above: GiB, sections 1-15.
#
# A Run is one fine-tune, in the order it happens. Its set-up reads the flags (there, and
# nowhere after) and every input, each checked before anything is built, then builds the model
# and resumes it; train() is the loop over steps; finish() merges, samples and sums up. What
# it hands the pieces above (long context, the estimate, the files, the data) is explicit: a
# Plan, paths, numbers.


def model_config(checkpoint, model):
    """(name, FamilyConfig): the checkpoint directory's (named after it), else CONFIGS[model]."""
    if not checkpoint:
        return model, as_family(CONFIGS[model])
    require(os.path.isdir(checkpoint), f"--checkpoint {checkpoint}: no such directory")
    path = os.path.join(checkpoint, "config.json")
    name = os.path.basename(os.path.normpath(checkpoint))
    return name, config_from_hf(read_json(path), path)


def plan_of(args, config, world, local, device):
    """The flags' Plan for `world` ranks (`local` of them on this machine), its state sharded
    over --shard_size's groups (or all ranks), its --context_parallel checked; then --fit's
    choice where asked, in the Budget of `device`: what a run follows and --estimate shows."""
    plan = Plan.of(args, shard_size(args.shard_size, world, local))
    if args.adapter:  # the adapters' shape is the run's; a flag that says otherwise is refused
        settings = peft_settings(args.adapter)
        for key, value in settings.items():
            given = f"--{key}" in args.argv and getattr(args, key) != value
            require(not given, f"--{key} {getattr(args, key)}: --adapter's is {value}")
        plan = dataclasses.replace(plan, **settings)
    check_context_parallel(plan.context_parallel, plan.seq_len, world, plan.shard, config)
    check_tiles(plan)
    if args.fit is not None:
        cuda = device.type == "cuda"
        capability = torch.cuda.get_device_capability(device) if cuda else None
        plan = fit(config, plan, budget_of(device, args.fit, local), capability)
    return plan


def build(config, plan, device, sources=None, path=None):
    """(model, fsdp), as section 8's build_sharded, but load_model's (sources: the base at `path`,
    or None: drawn), sharded over an HSDP mesh where plan.shard is less than the world; then the
    blocks set up to run as the plan says."""
    world = world_and_rank()[0]
    mesh = None
    if plan.shard < world:  # HSDP: the groups of shard ranks replicate
        shape = (world // plan.shard, plan.shard)
        names = ("dp_replicate", "dp_shard")
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    lora = (plan.lora_rank, plan.lora_alpha, plan.lora_dropout)
    kw = dict(compile=plan.compile, nf4_head=plan.nf4_head, dora=plan.dora)
    make = functools.partial(CausalLM, config, DTYPES[plan.dtype], *lora, **kw)
    sharding = dict(offload=plan.cpu_offload, mesh=mesh)
    model, fsdp = load_model(make, plan.seed, device, sources, path, sharding)
    model.checkpointing = plan.checkpointing
    model.context_parallel = context_groups(plan.context_parallel)
    if plan.offload_activations:
        # A stream of its own: a wait for a collective (on FSDP's side stream) must not wait
        # for these copies too.
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        model.offload_activations = OffloadedInputs(side)
    for i, layer in enumerate(model.model.layers):
        forward = layer.forward
        if plan.tile_tokens:  # compiled, each part of the block on its own
            forward = tiled(layer, plan.tile_tokens, plan.compile)
        elif plan.compile:  # each block's forward, its checkpoint included; hooks stay eager
            forward = torch.compile(forward)
            forward = _input_needs_grad(forward) if i == 0 else forward
        if model.offload_activations is not None:  # outside the compiled code
            forward = model.offload_activations.around(forward)
        layer.forward = forward
    if plan.tile_tokens:
        tile_the_loss(model, plan.tile_tokens)
    return model, fsdp


def _input_needs_grad(forward):
    """The first block's compiled forward, its input made to need a gradient, as every other
    block's does: then one graph serves all blocks (it would differ by that alone)."""

    def first(x, *args):
        if torch.is_grad_enabled() and not x.requires_grad:
            x = x.detach().requires_grad_()
        return forward(x, *args)

    return first


def configure_cuda_allocator():
    """Expandable segments, as torchtune and axolotl run, unless the user set the allocator up
    (before CUDA's allocator is first used)."""
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return
    # torch 2.13's name; the older one warns there.
    settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (settings or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")


WAIT_HINT_S = 60.0  # seconds the first collective may take before the hint below
WAITING_FOR_RANKS = (
    "still waiting for the other ranks after {seconds:.0f} s: did every rank start? NCCL "
    "hangs here on GPUs whose PCIe peer-to-peer is broken (consumer boards, IOMMU/ACS): "
    "NCCL_P2P_DISABLE=1; in Docker, /dev/shm too small for NCCL: docker run --shm-size=8g, or "
    "NCCL_SHM_DISABLE=1"
)


def connect(device_flag):
    """(device, world, rank): --device's (auto: CUDA if there is one), and under torchrun the
    process group, every rank met once."""
    cuda = torch.cuda.is_available() if device_flag == "auto" else device_flag == "cuda"
    require(torch.cuda.is_available() or not cuda, "--device cuda: no CUDA GPU is available")
    if cuda:
        configure_cuda_allocator()
    # A rank that never starts, or NCCL stuck on this machine, would wait here in silence.
    waiting = heartbeat(WAITING_FOR_RANKS, every=WAIT_HINT_S)
    try:
        device, world, rank = init_distributed(cuda)
        if world > 1:
            dist.barrier()  # the first collective: every rank is here, and the transport works
    finally:
        waiting.set()
    return device, world, rank


def max_over_ranks(value, device):
    """A number's max over the ranks (as float32, on `device`, where the collective runs)."""
    t = torch.tensor(float(value), device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def peak_memory_gib(device):
    """The peak memory since reset_peak_memory, the max over ranks: the GPU memory
    allocated, or on the CPU the resident set (Linux's VmHWM; elsewhere the process's)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        try:
            with open("/proc/self/status") as f:
                line = next(line for line in f if line.startswith("VmHWM:"))
            peak = int(line.split()[1]) * 1024  # kB
        except (OSError, StopIteration):  # not Linux: the peak of the whole process
            maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak = maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes there
    return max_over_ranks(peak / GiB, device)


def reset_peak_memory(device):
    """peak_memory_gib counts from now: CUDA's peak statistics, or Linux's VmHWM."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: VmHWM starts again from the resident set now
    except OSError:
        pass


def compile_counts():
    """(graphs compiled, of those recompiles: a frame compiled again) in this process so far;
    (0, 0) where the compiler was never imported. A silent fall back to eager shows here."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0, 0
    # guard_failures: code -> the failed guard of each compile again.
    recompiles = sum(len(failures) for failures in utils.guard_failures.values())
    return utils.counters["frames"]["ok"], recompiles


def require_on_all_ranks(problem):
    """Raise, on every rank, the first rank's problem (a message; None: none)."""
    if dist.is_initialized():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    require(problem is None, problem)


def check_writable(outputs, rank, resume=False):
    """Refuse now, on every rank, an output path that cannot be written (its nearest existing
    directory takes a temporary file), creating nothing, overwriting nothing: an --out with a
    checkpoint needs --resume, a --merge_to with a model is refused. outputs: {flag: path}."""
    problem = None
    out = outputs.get("--out")
    if rank == 0 and out and os.path.isfile(os.path.join(out, "latest")) and not resume:
        problem = f"--out {out}: holds a run's checkpoint; --resume continues it, or choose "
        problem += "another --out"
    merge_to = outputs.get("--merge_to")
    model_files = ("config.json", "model.safetensors", "model.safetensors.index.json")
    if rank == 0 and merge_to:
        if any(os.path.exists(os.path.join(merge_to, n)) for n in model_files):
            problem = f"--merge_to {merge_to}: holds a model already; choose a new directory"
    for flag, path in outputs.items():
        if not path or problem is not None or (rank != 0 and flag != "--profile"):
            continue
        existing = os.path.abspath(path)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        try:
            tempfile.TemporaryFile(dir=existing).close()
        except OSError as e:
            problem = f"{flag} {path}: cannot be written ({e.strerror or e})"
    require_on_all_ranks(problem)


def open_metrics(out, start):
    """(--out's metrics.jsonl open to append, the records kept): those after `start`, and a
    line a crash cut short, dropped."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "metrics.jsonl")
    kept = []
    if start and os.path.isfile(path):
        with open(path) as f:
            for line in f:
                line = line.rstrip()
                if line.endswith("}") and json.loads(line)["step"] <= start:
                    kept.append(line + "\n")
    atomic_write(path, lambda f: f.writelines(kept), "w")
    return open(path, "a"), [json.loads(line) for line in kept]


@torch.no_grad()
def evaluate(model, val, plan, n, world, rank, device):
    """(the mean loss over the counted targets, rows) of val's first n rows (at most: tokens
    [i T, i T + T + 1), or the i-th packed row in the file's order, each document once at
    most), in micro-batches of plan.batch_size per rank (of a context-parallel group), every
    rank running each one."""
    B = plan.batch_size
    n = min(n, val.row_count(plan.seq_len))
    pieces = plan.context_parallel
    rows_world, rows_rank = data_parallel(pieces, world, rank)
    # The loss's sum, and the count of its targets.
    total = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    for g in range(-(-n // (rows_world * B))):  # global micro-batches: B rows of each a rank
        first = (g * rows_world + rows_rank) * B
        rows = [*range(first, min(first + B, n))]
        rows += [None] * (B - len(rows))  # rows past the last: counting nothing
        batch = piece_of(val.rows(rows, plan.seq_len), pieces, rank % pieces)
        x, y, positions = (None if t is None else t.to(device) for t in batch)
        loss_sum = model(x, y, "sum", positions).double()
        counted = (y != IGNORE_INDEX).sum().double()
        total += torch.stack([loss_sum, counted])
    model.train()
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).item(), n


def step_batches(data, step, plan, world, rank, vocab_size):
    """This rank's micro-batches of `step`: rows of data (a TokenData's windows, or packed rows)
    or random tokens (None); under context_parallel its pieces of its group's rows."""
    n = plan.context_parallel
    rows_world, rows_rank = data_parallel(n, world, rank)
    get = functools.partial(get_batch, None, vocab_size=vocab_size)
    if data is not None:
        get = data.batch
    batches = [get(step, m, plan, rows_world, rows_rank) for m in range(plan.grad_accum)]
    return [piece_of(b, n, rank % n) for b in batches]


def refuse_unfused_attention(plan, device):
    """--pack on CUDA runs flex_attention, fused only when compiled: eager it materializes the
    (B, heads, T, T) scores that the block mask exists to avoid."""
    require(
        not (plan.pack and device.type == "cuda" and not plan.compile),
        "--pack with --no-compile on CUDA: flex_attention runs unfused, materializing (batch, "
        "heads, seq_len, seq_len) scores; drop --no-compile",
    )


def printable(text):
    """text with each character that would not print (but newlines and tabs) as repr escapes
    (a terminal's control codes are never sent to it); invalid UTF-8 shows as U+FFFD."""
    return "".join(ch if ch.isprintable() or ch in "\n\t\ufffd" else repr(ch)[1:-1] for ch in text)


class Interrupted(Exception):
    """A SIGINT or SIGTERM that stopped the run; main() says where, in one line."""

    def __init__(self, signum, where):
        super().__init__(where)
        self.signum = signum


class Signals:
    """SIGINT and SIGTERM (a scheduler's) while `with` lasts: before and after training they
    interrupt at once; during it the loop stops after the step in progress, every rank at the
    same step, saving it first with --out (Run.train): nothing is lost. A second signal while
    the step finishes interrupts at once (the last checkpoint is as it was)."""

    def __init__(self):
        self.run = None  # the Run to tell, while it trains
        self.where = "before training: nothing to save"  # what a signal outside training says
        self.saved = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.saved[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        if self.run is None:
            raise Interrupted(signum, self.where)
        if self.run.signal is not None:  # asked twice: now
            step = self.run.step
            raise Interrupted(signum, f"a second time during step {step + 1}: stopped at once")
        self.run.signal = signum


def heartbeat(line, every=None):
    """Print `line` ({seconds}: the time so far) on rank 0 every `every` s (PROGRESS_S), from a
    thread, until the returned Event is set: for what runs long (step 1's compile)."""
    every = every or PROGRESS_S
    start = time.perf_counter()
    stop = threading.Event()

    def beat():
        while not stop.wait(every):
            if not dist.is_initialized() and os.environ.get("RANK", "0") != "0":
                continue  # before the process group too, rank 0 alone speaks
            print0(line.format(seconds=time.perf_counter() - start))

    threading.Thread(target=beat, daemon=True).start()
    return stop


def continue_command(argv):
    """The command that continues a run from its checkpoint: the same, with --resume, under
    torchrun as this one was (on each machine, the same but --node_rank)."""
    argv = list(argv)
    if "--resume" not in argv:
        argv.append("--resume")
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    launcher = ["python"]
    if world > 1:
        launcher = ["torchrun", "--nproc_per_node", str(local)]
    if world > local:  # several machines: the rendezvous they met at
        nodes = world // local
        address = f"{os.environ.get('MASTER_ADDR', 'HOST')}"
        port = os.environ.get("MASTER_PORT", "29500")
        node = os.environ.get("GROUP_RANK", "0")
        launcher += ["--nnodes", str(nodes), "--node_rank", node, "--master_addr", address]
        launcher += ["--master_port", port]
    script = shlex.quote(os.path.relpath(__file__))
    return " ".join([*launcher, script, *map(shlex.quote, argv)])


def cache_dir():
    """Where tokenized files are kept: $XDG_CACHE_HOME/qlora_fsdp (~/.cache by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "qlora_fsdp")


def tokenized(path, checkpoint, flag):
    """TokenData of a text or .jsonl file, tokenized by the checkpoint's tokenizer once per
    machine: its local rank 0 tokenizes (or finds the cache), then the others read the cache."""
    require(os.path.isfile(path), f"{flag} {path}: no such file")
    first = int(os.environ.get("LOCAL_RANK", 0)) == 0
    problem = None
    if first:
        try:
            data = tokenize_file(path, checkpoint, cache_dir(), say=print0)
        except UserError as e:
            problem = str(e)
    require_on_all_ranks(problem)  # one rank's error is every rank's
    return data if first else tokenize_file(path, checkpoint, cache_dir())


def due(step, every):
    """Whether `step` is one of every --eval_every / --save_every steps (0: none)."""
    return every > 0 and step % every == 0


class Run:
    """One fine-tune as the flags say: Run(args) sets it up (every input read and checked, in
    order, before the model is built and resumed), train() runs the loop over steps, finish()
    merges, samples and returns the summary."""

    def __init__(self, args):
        self.args = args
        self.device, self.world, self.rank = connect(args.device)
        self.name, self.config = model_config(args.checkpoint, args.model)
        self.plan = self._plan()
        self.tokenizer = self._tokenizer()
        require(not args.pack or args.data != "dummy", "--pack needs documents: a --data file")
        self.data = None  # random tokens, or no step to take them
        if args.data != "dummy" and args.steps > 0:  # without --data, this file's bytes
            self.data = self._read("--data", args.data or __file__)
        self.val = self._read("--val_data", args.val_data) if args.val_data else None
        # --chat without a prompt: a conversation on the terminal, after training or instead.
        self.conversing = args.chat and args.prompt is None and not args.prompt_file
        self.prompts = self._prompts() if args.sample and not self.conversing else None
        check_window(self.config, self.plan.seq_len, f"--seq_len {self.plan.seq_len}")
        sources = self._sources()
        self.predicted = self._check_memory()  # the step's peak, GiB per GPU: an OOM quotes it
        refuse_unfused_attention(self.plan, self.device)
        # The adapters to start from, --resume's checkpoint or --adapter's, checked now.
        self.flags = {k: getattr(self.plan, k, getattr(args, k)) for k in RESUME_MUST_MATCH}
        shapes = adapter_shapes(self.config, self.plan.lora_rank, self.plan.dora)
        saved = read_training_state(args.out, self.flags, shapes) if args.resume else None
        adapter = read_adapter(args.adapter, shapes) if args.adapter and not saved else None
        outputs = {"--out": args.out, "--merge_to": args.merge_to, "--profile": args.profile}
        check_writable(outputs, self.rank, args.resume)
        self._build(sources, saved, adapter)
        self.step = self.start  # the last step done
        self.records = []  # each step's StepRecord
        self.val_losses = []
        self.first_peaks = None  # step 1's peaks: compiling, autotuning, first allocations
        self.metrics = None
        self.history = []  # after --resume, the records of the steps before, from metrics.jsonl
        if args.out and self.rank == 0:
            self.metrics, self.history = open_metrics(args.out, self.start)
        self.profiler = self._start_profiler() if args.profile else None
        self.signal = None  # SIGINT or SIGTERM, once received (Signals sets it)

    # The set-up, in the order __init__ calls it.

    def _plan(self):
        """plan_of's, and a warning where its shard groups span machines."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        plan = plan_of(self.args, self.config, self.world, local, self.device)
        if local % plan.shard:
            print0(
                f"warning: --shard_size {plan.shard} makes groups that span machines of {local} "
                f"ranks: their all-gathers cross the network (it works, slower)"
            )
        return plan

    def _tokenizer(self):
        """--checkpoint's Tokenizer, where its text data or --prompt need one; else None (a
        sample is then shown as ids when the tokenizers package is missing)."""
        args = self.args
        if not args.checkpoint:
            return None
        files = [f for f in (args.data or __file__, args.val_data) if f and f != "dummy"]
        if any(is_text(f) for f in files) or args.chat or args.prompt_file:
            return Tokenizer.load(args.checkpoint)
        with contextlib.suppress(UserError):
            return Tokenizer.load(args.checkpoint) if args.sample else None
        return None

    def _read(self, flag, path):
        """A data file as the loop takes it: windows of one token stream; rows of examples, one
        a row (a longer one cut into pieces of --seq_len); with --pack, rows packed with
        documents."""
        plan = self.plan
        vocab_size = self.config.vocab_size
        where = f"{flag} {path}"
        checkpoint = self.args.checkpoint
        if is_text(path) and self.tokenizer is not None:
            data = tokenized(path, checkpoint, flag)
            check_ids(data.ids, vocab_size, where)
        else:  # ids; text as bytes, for a byte-level model only
            require(
                not (is_text(path) and checkpoint and vocab_size != 256),
                f"{where}: text needs --checkpoint's tokenizer, and {checkpoint} has no "
                f"tokenizer.json; pass token ids as .npy",
            )
            require(
                not path.lower().endswith(".jsonl"),
                f"{where}: JSON lines need --checkpoint's tokenizer and chat template (a byte "
                f"model would learn their JSON)",
            )
            data = load_tokens(path, vocab_size, flag)
        examples = data.starts is not None and len(data.starts) > 1
        shuffle = flag == "--data"  # --val_data in the file's order
        if plan.pack or examples:
            eos = self._eos() if data.starts is None else None
            per_row = None if plan.pack else 1
            rows = PackedDocuments(data, eos, plan.seq_len, plan.seed, shuffle, per_row)
            long = len(rows.starts) - len(data.starts) if examples and not plan.pack else 0
            if long:
                print0(
                    f"{where}: {len(data.starts):,} examples, {long:,} pieces beyond --seq_len "
                    f"{plan.seq_len} (a longer example is cut into pieces, a row each; --pack "
                    f"packs)"
                )
            return rows
        n = len(data.ids)  # a row is seq_len tokens and the one after them
        require(
            n > plan.seq_len, f"{where}: {n} tokens, fewer than --seq_len + 1 = {plan.seq_len + 1}"
        )
        return data

    def _eos(self):
        """--pack's end of a document: --eos_id, else --checkpoint's config.json's eos_token_id."""
        eos = self.args.eos_id
        if eos is None and self.args.checkpoint:  # several: the first ends a document
            eos = (eos_ids(self.args.checkpoint, "config.json") or [None])[0]
        require(
            type(eos) is int,
            "--pack: documents end with an EOS token; give its id with --eos_id (config.json "
            "has no eos_token_id)",
        )
        require(0 <= eos < self.config.vocab_size, f"--eos_id {eos}: not a token of this model")
        return eos

    def _prompts(self):
        """--sample's prompts, each with its sample within the model's window."""
        args = self.args
        where = "--prompt_file" if args.prompt_file else "--chat" if args.chat else "--prompt"
        vocab_size = self.config.vocab_size
        prompts = read_prompts(args.prompt, args.prompt_file, args.chat, vocab_size, self.tokenizer)
        longest = max(len(p.ids) for p in prompts) + args.sample
        check_window(self.config, longest, f"--sample {args.sample}: {where} and its sample")
        return prompts

    def _sources(self):
        """--checkpoint's tensors (load_checkpoint's), and a line where it is a merged export."""
        path = self.args.checkpoint
        if not path:
            return None
        sources = load_checkpoint(path, self.config)
        if any(sf.metadata.get(MERGED) for sf, _ in sources.values()):
            print0(
                f"warning: --checkpoint {path} is a merged export, whose NF4 rounds most of the "
                f"fine-tune away: give its base as --checkpoint and its adapters as --adapter"
            )
        return sources

    def _check_memory(self):
        """Refuse, before anything is allocated, a model whose sharded state would not fit on
        the GPU or in this machine's available memory (offloaded, or on a CPU; its ranks share
        it). -> the step's predicted peak, GiB per GPU."""
        cuda = self.device.type == "cuda"
        capability = torch.cuda.get_device_capability(self.device) if cuda else None
        est = estimate_memory(self.config, self.plan, capability)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        why = shortfall(est, budget_of(self.device, local_ranks=local), whole_step=False)
        require(
            why is None,
            f"the model's shards need {why} (--estimate): more ranks, --cpu_offload, or --fit to "
            f"choose the settings",
        )
        return est.gpu_peak / GiB

    def _build(self, sources, saved, adapter):
        """The model, its AdamW, the adapters it starts from (saved: --resume's checkpoint,
        read_training_state's; adapter: --adapter's tensors), and the steps to run."""
        args = self.args
        plan = self.plan
        if args.steps > 0:  # what training keeps
            counts = count_family_params(self.config, plan.lora_rank, plan.nf4_head, plan.dora)
            print0(format_budget(self.name, memory_budget(counts)))
        path = args.checkpoint
        self.model, self.fsdp = build(self.config, self.plan, self.device, sources, path)
        # The peaks of training, not of loading (--estimate has both): what loading left cached
        # goes back first.
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        reset_peak_memory(self.device)
        hyper = dict(lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay)
        self.optimizer = AdamW(self.fsdp.parameters(), **hyper)
        lora = (plan.lora_rank, plan.lora_alpha, plan.lora_dropout, plan.dora)
        self.peft = peft_config(*lora, base=args.checkpoint or "")
        self.start = resume(saved, self.fsdp, self.optimizer) if saved else 0
        for name, t in (adapter or {}).items():
            self.fsdp.load_full(name, t)
        self.end = min(args.steps, args.stop_at or args.steps)
        require(
            self.start < self.end or not args.resume,
            f"nothing to do: --resume is at step {self.start}, the run ends at step {self.end} "
            f"(--steps {args.steps}, --stop_at {args.stop_at}); to use what it trained: "
            f"--adapter {args.out} --steps 0",
        )
        require(
            not args.profile or self.end - self.start >= 3,
            f"--profile traces steps 3-5: this run has {self.end - self.start}",
        )
        mib = self.fsdp.local_bytes() / 2**20
        print0(
            f"model {self.name}: {mib:.1f} MiB of weights on this rank, world {self.world}, "
            f"{self.device}, {self.plan.dtype}, compile {self.plan.compile}, checkpointing "
            f"{self.plan.checkpointing}, offload {self.plan.cpu_offload}"
        )

    def _start_profiler(self):
        """A trace of steps 3-5, after compilation and warm-up."""
        os.makedirs(self.args.profile, exist_ok=True)
        profiler = torch.profiler.profile(
            activities=torch.profiler.supported_activities(),  # the CPU's, and CUDA's if present
            profile_memory=True,
            on_trace_ready=self._export_profile,
            schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        )
        profiler.start()
        return profiler

    def _export_profile(self, profiler):
        """After step 5, or at the end of a shorter run."""
        trace = os.path.join(self.args.profile, f"trace_rank{self.rank}.json")
        profiler.export_chrome_trace(trace)
        print0(f"profile: {trace} (open in https://ui.perfetto.dev or chrome://tracing)")
        if self.device.type == "cuda":
            # The allocator's history recorded so far; then no more recording.
            path = os.path.join(self.args.profile, f"memory_rank{self.rank}.pickle")
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)
            print0(f"memory snapshot: {path} (drag into https://pytorch.org/memory_viz)")

    # The loop.

    def train(self):
        """The loop over steps: a line every --log_every steps, an evaluation at the end (not
        --stop_at's) and when due, a save at the end (--stop_at's too) and when due; on a
        signal, after the step, a save first, then stop. -> the signal all ranks stopped for
        (None: none)."""
        args = self.args
        if self.val and self.start == 0:  # what the fine-tune starts from (not after --resume)
            self.evaluate(0)
        compiling = threading.Event()  # once set, no "still compiling" lines
        if self.plan.compile and self.start < self.end:  # (no step: nothing compiles)
            print0("compiling the first step (about a minute on a CPU); --no-compile skips it")
            compiling = heartbeat("still compiling the first step: {seconds:.0f} s so far")
        try:
            for step in range(self.start, self.end):
                r = self.run_step(step)
                if (r.step - 1) % args.log_every == 0 or r.step == self.end:
                    self.log(r)
                if r.step == self.start + 1:
                    # Step 1's peaks (compiling, autotuning, first allocations) apart from the rest.
                    compiling.set()
                    self.first_peaks = self.peaks()
                    reset_peak_memory(self.device)
                if self.val and (r.step == args.steps or due(r.step, args.eval_every)):
                    self.evaluate(r.step)
                saved = bool(args.out) and (r.step == self.end or due(r.step, args.save_every))
                if saved:
                    self.save(r.step)
                # Any rank's SIGINT or SIGTERM stops every rank at this step.
                signum = int(max_over_ranks(self.signal or 0, self.device))
                if signum:
                    if args.out and not saved:
                        self.save(r.step)
                    return signum
        finally:
            compiling.set()
        return None

    def run_step(self, step):
        """Section 8's run_step over this rank's batches of `step`; out of memory and a
        non-finite loss are one line each."""
        plan = self.plan
        vocab_size = self.config.vocab_size
        batches = step_batches(self.data, step, plan, self.world, self.rank, vocab_size)
        try:
            r = run_step(
                self.model, self.fsdp, self.optimizer, batches, self.args, self.device, step
            )
        except torch.OutOfMemoryError:
            raise UserError(self.out_of_memory()) from None
        except FloatingPointError as e:  # no save since
            out = self.args.out
            intact = f"; the last checkpoint in {out} is intact" if out else ""
            raise UserError(f"{e}{intact}") from None
        self.step = r.step
        self.records.append(r)
        if self.profiler is not None:
            self.profiler.step()
            # On CUDA, the allocator's history over steps 3-5 (Python stacks only: cheap).
            if self.profiler.step_num == 2 and self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
        return r

    def out_of_memory(self):
        """The line for a step out of memory (on one rank: it exits, and torchrun ends the rest)."""
        if self.device.type == "cuda":
            total = torch.cuda.mem_get_info(self.device)[1]
        else:
            total = os.sysconf("SC_PHYS_PAGES") * resource.getpagesize()
        return (
            f"out of memory on {self.device} at step {self.step + 1}: --estimate predicted a peak "
            f"of {self.predicted:.2f} GiB per GPU, the device has {total / GiB:.2f} GiB; --fit "
            f"chooses settings that fit"
        )

    def peaks(self):
        """(allocated, reserved) peaks since the last reset, in GiB (on a CPU: the RSS, twice)."""
        allocated = peak_memory_gib(self.device)
        if self.device.type != "cuda":
            return allocated, allocated
        reserved = torch.cuda.max_memory_reserved(self.device) / GiB
        return allocated, max_over_ranks(reserved, self.device)

    def record(self, **fields):
        """A line of metrics.jsonl, on disk at once (a crashed run keeps what it logged)."""
        if self.metrics:
            print(json.dumps(fields), file=self.metrics, flush=True)

    def log(self, r):
        """The step's line, with the peak memory (a collective), and its metrics record."""
        mem = peak_memory_gib(self.device)
        memory = "mem" if self.device.type == "cuda" else "rss"
        print0(f"{format_step(r, self.args.steps)} | {memory} {mem:.2f} GiB")
        self.record(
            step=r.step,
            loss=r.loss,
            lr=r.lr,
            ms=round(r.seconds * 1000, 2),
            tokens_per_s=round(r.tokens / r.seconds, 1),
            mem_gib=round(mem, 4),
        )

    def evaluate(self, step):
        """The held-out loss after `step` steps (0: the base, before training), logged."""
        n = self.args.eval_seqs
        val_loss, n = evaluate(
            self.model, self.val, self.plan, n, self.world, self.rank, self.device
        )
        self.val_losses.append(val_loss)
        what = "packed rows" if self.plan.pack else "sequences"
        print0(f"eval step {step} | val_loss {val_loss:.4f} | {n} {what} of --val_data")
        self.record(step=step, val_loss=val_loss)

    def save(self, step):
        start = time.perf_counter()
        out = self.args.out
        save_checkpoint(out, step, self.fsdp, self.optimizer, self.peft, self.flags)
        seconds = time.perf_counter() - start
        print0(f"saved {os.path.join(out, f'checkpoint-{step}')} (step {step}) in {seconds:.1f} s")

    def where_stopped(self):
        """Where a stopped run is: its step, the checkpoint saved, the command that continues it."""
        args = self.args
        where = f"after step {self.step} of {args.steps}"
        if not args.out:
            return f"{where}; nothing is saved without --out"
        where += f"; {os.path.join(args.out, f'checkpoint-{self.step}')} is saved"
        if self.step < args.steps:
            where += f"; continue it with: {continue_command(args.argv)}"
        return where

    # The end.

    def finish(self):
        """After the loop: merge, sample, the closing line of losses; -> the summary dict."""
        args = self.args
        if self.profiler is not None:
            self.profiler.stop()  # exports steps 3 to the last, if the run ended before step 5
        # The steady state's peaks (for one step: step 1's), before --merge_to and --sample
        # allocate their own.
        steady = self.first_peaks if len(self.records) == 1 else self.peaks()
        if args.merge_to:
            max_shard_bytes = args.max_shard_size * 1e9
            save_merged(args.merge_to, self.fsdp, self.model, args.checkpoint, max_shard_bytes)
            print0(f"merged model written to {args.merge_to}")
        samples = {}
        if self.conversing:  # after the saves: what was trained is on disk whatever happens here
            samples = self._converse()
        elif args.sample:
            samples = self._sample()
        # The whole run's losses: after --resume, the earlier steps' read back first.
        losses = [r["loss"] for r in self.history if "loss" in r]
        losses += [r.loss for r in self.records]
        val_losses = [r["val_loss"] for r in self.history if "val_loss" in r]
        val_losses += self.val_losses
        curves = [f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"] if losses else []
        if val_losses:
            curves.append(f"val_loss {val_losses[0]:.3f} -> {val_losses[-1]:.3f}")
        if self.history:
            curves[-1] += f" (steps 1-{self.step}; 1-{self.start} read back from metrics.jsonl)"
        if curves:  # none with --steps 0 and no --val_data
            print0(" | ".join(curves))
        return self._summary(steady, samples, losses, val_losses)

    def _text(self, ids):
        """ids as a sample shows them: text, special tokens and all (a byte-level model's
        UTF-8, invalid bytes as U+FFFD), or the ids where there is no tokenizer."""
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        if self.config.vocab_size == 256:
            return bytes(ids).decode("utf-8", errors="replace")
        return list(ids)

    def _sample(self):
        """A reply to each prompt, printed (the stop token not), and with --out written to
        OUT/samples.jsonl, an object a line; -> the summary's fields."""
        args = self.args
        stop = stop_ids(args.checkpoint, args.eos_id)
        prompts = self.prompts
        records = []
        for i, prompt in enumerate(prompts, 1):
            kw = dict(stop=stop, seed=args.seed, device=self.device)
            ids = generate(self.model, prompt.ids, args.sample, args.temperature, **kw)
            stopped = bool(ids) and ids[-1] in stop
            reply = self._text(ids[:-1] if stopped else ids)
            end = f"stopped at {self._text(ids[-1:])!r}" if stopped else "reached its length"
            n = len(ids) - stopped
            head = f"sample {i}/{len(prompts)}" if len(prompts) > 1 else "sample"
            print0(f"{head} ({n} tokens, {end}; temperature {args.temperature}):")
            # Escaped where a character would not print (a control byte, invalid UTF-8).
            print0(reply if isinstance(reply, list) else printable(self._text(prompt.ids) + reply))
            record = dict(messages=prompt.messages) if prompt.messages else dict(prompt=args.prompt)
            record.update(reply=reply, stopped=stopped, tokens=n)
            if prompt.reference is not None:
                record["reference"] = prompt.reference
            records.append(record)
        self.fsdp.reshard()  # the last forward left its last unit gathered
        if args.out and self.rank == 0:
            lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
            path = os.path.join(args.out, "samples.jsonl")
            atomic_write(path, lambda f: f.write(lines.encode("utf-8")))
        if len(records) == 1:
            return dict(sample=records[0]["reply"], sample_stopped=records[0]["stopped"])
        return dict(samples=len(records), samples_stopped=sum(r["stopped"] for r in records))

    def _converse(self):
        """--chat without a prompt: a conversation on the terminal, a user turn a line of
        rank 0's standard input (every rank is told it), each reply streamed as it comes, the
        history kept under the chat template, until the input ends. -> the summary's fields."""
        messages = []
        while True:
            if self.rank == 0 and sys.stdin.isatty():
                print("> ", end="", flush=True)
            line = [sys.stdin.readline() if self.rank == 0 else None]
            if dist.is_initialized():
                dist.broadcast_object_list(line, src=0)
            if not line[0]:  # the input ended
                if self.rank == 0 and sys.stdin.isatty():
                    print()  # after the "> " that Ctrl-D answered
                break
            messages.append({"role": "user", "content": line[0].rstrip("\n")})
            reply = self._reply(messages)
            if reply is None:
                break
            messages.append({"role": "assistant", "content": reply})
        self.fsdp.reshard()  # the last forward left its last unit gathered
        return dict(turns=len(messages) // 2)

    def _reply(self, messages):
        """The model's reply to a conversation, printed as each token comes; None where the
        conversation has reached the model's context (said in a line)."""
        args = self.args
        stop = stop_ids(args.checkpoint, args.eos_id)
        context = min(self.config.max_position_embeddings, self.config.sliding_window or math.inf)
        ids = self.tokenizer.encode_chat(messages, "--chat")
        room = min(args.sample, context - len(ids))
        if room < 1:
            print0(f"(the conversation has reached the model's context, {context} tokens)")
            return None
        shown = [0]  # characters of the reply printed so far

        def stream(new):
            text = self._text([i for i in new if i not in stop])
            text = text[: len(text.rstrip("\ufffd"))]  # a character's bytes not all here yet
            print0(printable(text[shown[0] :]), end="")
            shown[0] = len(text)

        kw = dict(stop=stop, seed=args.seed + len(messages), device=self.device, each=stream)
        new = generate(self.model, ids, room, args.temperature, **kw)
        stopped = bool(new) and new[-1] in stop
        reply = self._text(new[:-1] if stopped else new)
        print0(printable(reply[shown[0] :]))
        if not stopped and room < args.sample:
            print0(f"(the reply reached the model's context, {context} tokens)")
        return reply

    def _summary(self, steady, samples, losses, val_losses):
        """The JSON line; with --steps 0 (no step) its step fields are null."""
        # The median over the steps after the first (which compiles), in ms.
        seconds = [r.seconds for r in self.records]
        step_ms = float(np.median(seconds[1:] or seconds)) * 1000 if seconds else None
        first = self.first_peaks or (None, None)
        summary = dict(
            model=self.name,
            world_size=world_and_rank()[0],
            steps=self.step,
            final_loss=losses[-1] if losses else None,
            first_loss=losses[0] if losses else None,
            step_ms=None if step_ms is None else round(step_ms, 2),
            tokens_per_s=None,
            peak_mem_gib=round(steady[0], 4),
            step1_peak_mem_gib=first[0] and round(first[0], 4),
            predicted_peak_gib=round(self.predicted, 4),
            seq_len=self.plan.seq_len,
            **{key: getattr(self.plan, key) for key in FIT_FLAGS},
            dtype=self.plan.dtype,
            device=self.device.type,
        )
        if seconds:
            summary["tokens_per_s"] = round(self.records[-1].tokens / (step_ms / 1000), 1)
        summary["compiles"], summary["recompiles"] = compile_counts()
        if self.device.type == "cuda":
            summary["peak_reserved_gib"] = round(steady[1], 4)
            summary["step1_peak_reserved_gib"] = first[1] and round(first[1], 4)
        else:  # the process's resident set, not a device's memory; the prediction is a GPU's
            summary["peak_rss_gib"] = summary["peak_mem_gib"]
            summary["predicted_gpu_peak_gib"] = summary["predicted_peak_gib"]
        if val_losses:
            summary["first_val_loss"] = val_losses[0]
            summary["val_loss"] = val_losses[-1]
        summary.update(samples)
        return summary


def fine_tune(args):
    """Train as the flags say: set up, the loop over steps, finish. -> (summary dict, losses,
    fsdp)."""
    with Signals() as signals:
        run = Run(args)
        signals.run = run  # a signal now stops the loop after its step
        try:
            stopped_by = run.train()
        finally:
            signals.run = None
        if stopped_by:
            raise Interrupted(stopped_by, run.where_stopped())
        signals.where = f"{run.where_stopped()}; the --merge_to or --sample after it was cut short"
        summary = run.finish()
    return summary, [r.loss for r in run.records], run.fsdp


# -----------------------------------------------------------------------------
# 17. The command line
# -----------------------------------------------------------------------------
# Needs: import argparse, json, logging, math, os, signal, sys, time, numpy as np, torch,
# torch.distributed as dist; from above: GiB, sections 1-16.


def _fit_value(v):
    """--fit's number, or "auto" when none is given."""
    return v if v == "auto" else float(v)


def _add_flags(parser):
    """The flags, in the groups that --help shows (each with its default)."""
    _model_flags(parser.add_argument_group("the model"))
    _data_flags(parser.add_argument_group("the data"))
    p = parser.add_argument_group("the optimization")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (0: train nothing)")
    p.add_argument("--grad_accum", type=int, default=1, help="micro-batches a step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    p.add_argument("--warmup_steps", type=int, default=10, help="linear warmup, then cosine")
    p.add_argument("--weight_decay", type=float, default=0.0, help="AdamW's, decoupled")
    p.add_argument("--adam_eps", type=float, default=1e-8, help="AdamW's epsilon")
    p.add_argument("--seed", type=int, default=1337, help="the batches, adapters and dropout")
    p.add_argument("--grad_clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    p = parser.add_argument_group("checkpoints and exports")
    p.add_argument("--out", metavar="DIR", help="write PEFT adapters and resumable state here")
    p.add_argument("--save_every", type=int, default=0, help="save every N steps (0: at the end)")
    p.add_argument("--resume", action="store_true", help="continue --out's latest checkpoint")
    p.add_argument("--stop_at", type=int, default=0, help="stop after step N, as if interrupted")
    merge = "write the merged model in bf16 or fp32 (Hugging Face's, with the tokenizer)"
    p.add_argument("--merge_to", metavar="DIR", help=merge)
    size = "the merged model's files at most this size"
    p.add_argument("--max_shard_size", type=float, default=5.0, metavar="GB", help=size)
    _speed_flags(parser.add_argument_group("memory and speed"))
    p = parser.add_argument_group(
        "a sample or a conversation after training (or instead: --steps 0)"
    )
    most = "at most N new tokens after the prompt (given a prompt or --chat: 256 unless set)"
    p.add_argument("--sample", type=int, default=0, metavar="N", help=most)
    text = "text (the checkpoint's tokens, else bytes), or token ids: 1,791"
    p.add_argument("--prompt", help=text)
    chat = (
        "--prompt is a user's turn in --checkpoint's chat template; without --prompt or "
        "--prompt_file, a conversation: a turn a line of standard input"
    )
    p.add_argument("--chat", action="store_true", help=chat)
    chats = 'a reply to each {"messages": [...]} line, also in --out\'s samples.jsonl'
    p.add_argument("--prompt_file", metavar="FILE.jsonl", help=chats)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")


def _model_flags(p):
    p.add_argument("--model", default="tiny", help=f"one of {', '.join(CONFIGS)}")
    families = "a Hugging Face Llama, Mistral, Qwen2 or Qwen3 directory"
    p.add_argument("--checkpoint", metavar="DIR", help=f"{families}; overrides --model")
    adapter = (
        "LoRA or DoRA adapters in PEFT's layout (a run's --out, one of its checkpoints) loaded "
        "onto --checkpoint's base; their r, lora_alpha and use_dora are the run's"
    )
    p.add_argument("--adapter", metavar="DIR", help=adapter)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="compute dtype")
    p.add_argument("--lora_rank", type=int, default=8, help="LoRA's r, on all 7 projections")
    p.add_argument("--lora_alpha", type=float, default=16.0, help="scaling = alpha / r")
    p.add_argument("--lora_dropout", type=float, default=0.0, help="on the adapters' input")
    dora = "DoRA instead of LoRA: a trained magnitude per output row too (PEFT's use_dora)"
    p.add_argument("--dora", action="store_true", help=dora)
    p.add_argument("--nf4_head", action="store_true", help="the lm_head in NF4 (else dense)")


def _data_flags(p):
    formats = (
        ".npy, .npz (+ loss_mask), .bin, dummy; with --checkpoint text or .jsonl (text, "
        "prompt + completion, messages), else other files as bytes; default: this file"
    )
    p.add_argument("--data", metavar="PATH", help=formats)
    tokenize = "tokenize --data with --checkpoint's tokenizer into FILE.npz, and stop"
    p.add_argument("--tokenize_to", metavar="FILE.npz", help=tokenize)
    p.add_argument("--batch_size", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--seq_len", type=int, default=128, help="tokens a sequence")
    p.add_argument("--val_data", metavar="PATH", help="held-out tokens, as --data: val_loss")
    p.add_argument("--eval_every", type=int, default=0, help="evaluate every N steps (0: at end)")
    p.add_argument("--eval_seqs", type=int, default=64, help="evaluate the first K sequences")
    p.add_argument("--pack", action="store_true", help="rows of whole documents, as if alone")
    ends = "the token that ends a document (--pack) and a sample (else config.json's)"
    p.add_argument("--eos_id", type=int, help=ends)


def _speed_flags(p):
    on_off = argparse.BooleanOptionalAction
    p.add_argument("--compile", action=on_off, default=True, help="NF4 kernels and blocks")
    p.add_argument("--checkpointing", action=on_off, default=True, help="per block")
    devices = ["auto", "cpu", "cuda"]
    p.add_argument("--device", default="auto", choices=devices, help="auto: cuda if available")
    p.add_argument("--cpu_offload", action="store_true", help="shards and AdamW on the host")
    hsdp = "shard in groups of N ranks that replicate (HSDP; 0: a node's ranks when a run"
    p.add_argument("--shard_size", type=int, default=0, metavar="N", help=hsdp + " spans nodes)")
    p.add_argument("--offload_activations", action="store_true", help="block inputs on the host")
    split = "each group of N ranks holds consecutive pieces of the same rows (Ulysses)"
    p.add_argument("--context_parallel", type=int, default=1, metavar="N", help=split)
    tiles = "a checkpointed block's norms, projections and MLP over K tokens at a time (0: none)"
    p.add_argument("--tile_tokens", type=int, default=0, metavar="K", help=tiles)
    p.add_argument("--estimate", action="store_true", help="print the memory per rank and exit")
    margin = FIT_MARGIN * 100
    fit = (
        "choose the micro-batch, checkpointing and offloads that fit GIB per GPU, keeping the "
        f"batch (no GIB, on CUDA: the free memory less {margin:.0f}%% of the GPU's); the flags "
        "for them are then ignored"
    )
    p.add_argument("--fit", nargs="?", const="auto", type=_fit_value, metavar="GIB", help=fit)
    p.add_argument("--profile", metavar="DIR", help="trace steps 3-5 (and CUDA's memory) to DIR")
    p.add_argument("--log_every", type=int, default=1, help="a step line every N steps")


# Integer flags that must be at least 1, and those that must be at least 0.
POSITIVE = "batch_size seq_len grad_accum lora_rank log_every eval_seqs context_parallel".split()
NON_NEGATIVE = "steps warmup_steps save_every stop_at sample temperature eval_every".split()
NON_NEGATIVE += ["shard_size", "tile_tokens"]
FINITE = "lr weight_decay adam_eps grad_clip lora_alpha lora_dropout temperature".split()


def _check_args(p, args):
    """Refuse, through the parser (a usage line and exit 2), flags that cannot work together."""
    for flag in POSITIVE + NON_NEGATIVE:
        least = 1 if flag in POSITIVE else 0
        if getattr(args, flag) < least:
            p.error(f"--{flag} must be >= {least}, got {getattr(args, flag)}")
    for flag in FINITE:
        if not math.isfinite(getattr(args, flag)):
            p.error(f"--{flag} must be a finite number, got {getattr(args, flag)}")
    sizes = ["max_shard_size"]
    if args.fit not in (None, "auto"):
        sizes.append("fit")
    for flag in sizes:
        if not 0 < getattr(args, flag) < math.inf:
            p.error(f"--{flag} must be a positive number (GB), got {getattr(args, flag)}")
    if not 0 <= args.lora_dropout < 1:
        p.error(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}")
    if args.model not in CONFIGS and not args.checkpoint:
        p.error(f"--model {args.model}: unknown, choose from {', '.join(CONFIGS)}")
    if args.tokenize_to and not args.tokenize_to.endswith(".npz"):
        p.error(f"--tokenize_to {args.tokenize_to}: the file must end in .npz")
    if (args.save_every or args.resume) and not args.out:
        p.error("--save_every and --resume need --out DIR")
    if args.prompt_file and args.prompt is not None:
        p.error("--prompt and --prompt_file: give one of them")
    if (args.chat or args.prompt_file) and not args.checkpoint:
        p.error("--chat and --prompt_file need --checkpoint (a tokenizer with a chat template)")
    if args.adapter and not args.checkpoint:
        p.error("--adapter needs --checkpoint, the base its adapters were trained on")
    if not args.sample and (args.prompt is not None or args.prompt_file or args.chat):
        args.sample = 256  # a prompt asks for a sample: at most this many tokens
    for flag in ("offload_activations", "tile_tokens"):
        if getattr(args, flag) and not args.checkpointing:
            p.error(f"--{flag} works in the checkpointed blocks: it needs --checkpointing")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, where it has one."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse, whose errors are one line (under torchrun, rank 0's alone)."""

    def error(self, message):
        exit_with(f"error: {message} (--help lists the flags)", 2)


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    about = __doc__.split("\n\n")[0].strip() + " Recipes: README.md, beside this file."
    p = _Parser(description=about, formatter_class=_Help)
    _add_flags(p)
    args = p.parse_args(argv)
    args.argv = argv  # what continue_command repeats
    _check_args(p, args)
    if args.checkpoint:
        # Absolute: as --resume saves and compares it.
        args.checkpoint = os.path.abspath(args.checkpoint)
    return args


def estimate(args):
    """--estimate: the memory tables, from the config alone (nothing is allocated)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    name, config = model_config(args.checkpoint, args.model)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    plan = plan_of(args, config, world, local, device)  # with --fit, the plan it would run
    est = estimate_memory(config, plan, torch.cuda.get_device_capability() if cuda else None)
    counts = count_family_params(config, args.lora_rank, args.nf4_head, args.dora)
    print0(format_budget(name, memory_budget(counts)))
    print0(format_estimate(name, est))
    summary = dict(model=name, world_size=world, shard_size=plan.shard)
    for key in ("seq_len", "dtype", "lora_rank", *FIT_FLAGS, "compile"):
        summary[key] = getattr(plan, key)
    summary["predicted_peak_gib"] = round(est.gpu_peak / GiB, 3)
    summary["predicted_host_gib"] = round(est.host_state / GiB, 3)
    return summary


def tokenize_to(args):
    """--tokenize_to: --data tokenized by --checkpoint's tokenizer (tokenize_file's, so once)
    into an .npz (tokens, loss_mask, starts: what --data takes), as axolotl preprocess does;
    nothing is built."""
    require(args.checkpoint and args.data, "--tokenize_to needs --checkpoint and --data")
    data = tokenize_file(args.data, args.checkpoint, cache_dir(), say=print0)
    arrays = dict(tokens=data.ids, loss_mask=data.loss_mask, starts=data.starts)
    atomic_write(args.tokenize_to, lambda f: np.savez(f, **arrays))
    targets = int(data.loss_mask.sum())
    print0(
        f"wrote {args.tokenize_to}: {len(data.starts):,} examples, {len(data.ids):,} tokens, "
        f"{targets:,} targets"
    )
    return dict(tokenize_to=args.tokenize_to, examples=len(data.starts), tokens=len(data.ids))


def first_to_say(rank):
    """Whether this rank is the lowest saying the same thing: each marks it in torchrun's store,
    then after half a second speaks only if no lower rank did."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"qlora_fsdp/said/{rank}", "1")
        time.sleep(0.5)
        return not any(store.check([f"qlora_fsdp/said/{r}"]) for r in range(rank))
    except Exception:  # noqa: BLE001 -- the store is gone with its host: say it
        return True


def exit_with(message, code):
    """One line on stderr, said once (the lowest rank that has it), then exit with `code`."""
    grouped = dist.is_initialized() and dist.get_world_size() > 1
    if grouped:
        says = first_to_say(dist.get_rank())
    else:  # before the process group exists, every rank meets the same input
        says = os.environ.get("RANK", "0") == "0"
    if says:
        print(message, file=sys.stderr, flush=True)
    if grouped:
        # A peer may wait in a collective, and tearing gloo's threads down under it aborts
        # this process: leave at once, and torchrun ends the peer.
        sys.stdout.flush()
        os._exit(code)
    raise SystemExit(code)


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.tokenize_to:
            summary = tokenize_to(args)
        elif args.estimate:
            summary = estimate(args)
        else:
            summary = fine_tune(args)[0]
    except UserError as e:  # bad input: one line, exit 2
        exit_with(f"error: {e}", 2)
    except torch.OutOfMemoryError as e:  # outside a step too
        first_line = str(e).splitlines()[0]
        exit_with(f"error: out of memory ({first_line}); --fit chooses settings", 2)
    except Interrupted as e:  # 130 for SIGINT, 143 for SIGTERM, as a shell reports them
        exit_with(f"interrupted ({signal.Signals(e.signum).name}) {e}", 128 + e.signum)
    except KeyboardInterrupt:  # after training (a merge, a sample): what was saved is whole
        exit_with("interrupted (SIGINT)", 128 + signal.SIGINT)
    print0(json.dumps(summary))
    if dist.is_initialized():
        # gloo's threads free each collective's tensors after it completes: let them, before
        # the teardown (else: an abort).
        dist.barrier()
        dist.destroy_process_group()
    return summary


def torchrun(argv=None):
    """torchrun with argv, as run.sh launches it: a failed rank's report cut to one line (the
    rank said what went wrong), its exit code passed on; Ctrl-C's is 128 + the signal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # said below
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        print(f"torchrun: rank {rank} exited with code {code}", file=sys.stderr)
        sys.exit(code)
    except SignalException as e:
        sys.exit(128 + e.sigval)


if __name__ == "__main__":
    main()
