"""Where a training step's time goes, from a `qlora_fsdp.py --profile DIR` chrome trace.

  python benchmarks/profile_breakdown.py DIR/trace_rank0.json [--lora_rank 8] [--top 5]

Every microsecond of each profiled step (the profiler's ProfilerStep#N spans, on the thread that
ran them) goes to exactly one category, by the op or label it was spent in:

  matmul         the base projections' and lm_head's matmuls (their operands have no dim equal
                 to the LoRA rank; with no shapes in the trace every matmul counts here)
  LoRA           matmuls with a dim equal to the LoRA rank: x A^T, (x A^T) B^T and their grads
  attention      scaled_dot_product_attention, forward and backward
  dequantize     the NF4 dequantization op, all of it
  norm/rope/elementwise  everything else inside compiled regions (their fused kernels are not
                 profiled on their own), and eager pointwise ops
  loss           the chunked cross entropy, less its matmuls
  comm           waiting for all-gathers and reduce-scatters, issuing them, blocking all-reduces
  copy-out       copying gathered shards into the full weights
  optimizer      clip + AdamW + zero_grad (the `optimizer` label)
  other          the rest: hooks, autograd engine, Python between ops, guards, allocation

Labels that own everything under them (optimizer, comm, copy-out, dequantize) win from the
outside in; otherwise the innermost matmul or attention op decides, then an enclosing loss, then
compiled regions and pointwise ops.
"""

import argparse
import json
import re
from collections import defaultdict

CATEGORIES = ["matmul", "LoRA", "attention", "dequantize", "norm/rope/elementwise", "loss", "comm",
              "copy-out", "optimizer", "other"]

MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
          "aten::mv", "aten::addmv", "aten::_addmm_activation"}
COMPILED = re.compile(r"^(## Call CompiledFxGraph|Torch-Compiled Region|CompiledFunction)")


def owning_label(name):
    """Categories whose label owns all the time spent under it."""
    if name == "optimizer":
        return "optimizer"
    if name == "fsdp::copy_out":
        return "copy-out"
    if name.startswith("fsdp::") or name.startswith("c10d::") or name.startswith("gloo:") \
            or name.startswith("nccl:") or name.startswith("record_param_comms"):
        return "comm"
    if "dequantize_nf4" in name:
        return "dequantize"
    return None


def op_category(e, lora_rank):
    """matmul / LoRA / attention for the op that decides its own time, else None."""
    name = e["name"]
    if name in MATMUL:
        dims = e.get("args", {}).get("Input Dims")
        if dims and lora_rank:
            # the two matrix dims of each operand: a (B, T, C) input's batch dims are not matmul dims
            if any(lora_rank in d[-2:] for d in dims if isinstance(d, list) and len(d) >= 2):
                return "LoRA"
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name \
            or "cudnn_attention" in name:
        return "attention"
    return None


def is_loss(name):
    n = name.lower()
    return "crossentropy" in n or "cross_entropy" in n or "nll_loss" in n or "log_softmax" in n


def is_elementwise(name):
    return bool(COMPILED.match(name)) or (name.startswith("aten::") and name not in
                                          {"aten::empty", "aten::empty_strided", "aten::view",
                                           "aten::as_strided", "aten::reshape", "aten::detach",
                                           "aten::resize_", "aten::set_", "aten::item",
                                           "aten::_local_scalar_dense"})


def classify(chain, lora_rank):
    """chain: the event and its ancestors, outermost first."""
    for e in chain:  # owning labels, from the outside in
        owner = owning_label(e["name"])
        if owner:
            return owner
    for e in reversed(chain):  # the innermost deciding op
        cat = op_category(e, lora_rank)
        if cat:
            return cat
    if any(is_loss(e["name"]) for e in chain):
        return "loss"
    if any(is_elementwise(e["name"]) for e in chain):
        return "norm/rope/elementwise"
    return "other"


def breakdown(trace, lora_rank=None):
    """{"steps": n, "step_ms": mean profiled step, "ms": {category: ms per step},
    "by_name_ms": {category: {op or label: ms per step}}, "has_shapes": bool, "gpu": bool}. Host
    time only: on a GPU trace (gpu True) an op's time is its launch, not its kernel's."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("no ProfilerStep# spans in the trace (was it written by --profile?)")
    tid = steps[0]["tid"]
    totals, names = defaultdict(float), defaultdict(float)
    has_shapes = False
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        inside = sorted((e for e in events if e["tid"] == tid and lo <= e["ts"] < hi and e is not step),
                        key=lambda e: (e["ts"], -e["dur"]))
        stack = [dict(step, end=hi, child=0.0)]

        def close(top):  # the top of the stack: its own time (less its children's) to its category
            cat, own = classify(stack, lora_rank), max(0.0, top["end"] - top["ts"] - top["child"])
            totals[cat] += own
            names[cat, "(between ops)" if top is stack[0] else top["name"]] += own

        for e in inside:
            has_shapes = has_shapes or "Input Dims" in e.get("args", {})
            while len(stack) > 1 and e["ts"] >= stack[-1]["end"] - 1e-3:
                close(stack[-1])
                stack.pop()
            parent = stack[-1]
            end = min(e["ts"] + e["dur"], parent["end"])  # clipped to its parent
            parent["child"] += end - e["ts"]
            stack.append(dict(e, end=end, child=0.0))
        while stack:
            close(stack[-1])
            stack.pop()
    n = len(steps)
    top = sorted(names.items(), key=lambda kv: -kv[1])
    gpu = any(e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") for e in events)
    return {"steps": n, "step_ms": sum(s["dur"] for s in steps) / n / 1000, "has_shapes": has_shapes, "gpu": gpu,
            "ms": {c: totals[c] / n / 1000 for c in CATEGORIES},
            "by_name_ms": {c: {name: ms / n / 1000 for (cat, name), ms in top if cat == c} for c in CATEGORIES}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--lora_rank", type=int, default=8)
    p.add_argument("--top", type=int, default=0, help="also list each category's N biggest ops or labels")
    args = p.parse_args()
    with open(args.trace) as f:
        b = breakdown(json.load(f), args.lora_rank)
    print(f"{b['steps']} profiled steps, {b['step_ms']:.1f} ms each"
          + ("" if b["has_shapes"] else " (no operand shapes in the trace: LoRA's matmuls count as matmul)")
          + (" (a GPU trace: these are host times, kernels run asynchronously)" if b["gpu"] else ""))
    for c, ms in b["ms"].items():
        print(f"  {c:<24} {ms:8.1f} ms  {100 * ms / b['step_ms']:5.1f}%")
        for name, own in list(b["by_name_ms"][c].items())[:args.top]:
            print(f"      {own:8.2f} ms  {name[:100]}")
    print(json.dumps({k: v for k, v in b.items() if k != "by_name_ms"}))


if __name__ == "__main__":
    main()
