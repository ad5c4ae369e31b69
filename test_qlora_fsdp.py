"""Tests for qlora_fsdp.py, in the file's order. One claim each, stated in the docstring, checked
against a reference: a dense F.linear, torch.optim.AdamW, a plain Llama written here, the
unsharded single-process run. Run: python -m pytest -q test_qlora_fsdp.py"""

import collections
import contextlib
import dataclasses
import filecmp
import functools
import gc
import io
import json
import math
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
import types
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import qlora_fsdp as qf

HERE = os.path.dirname(os.path.abspath(__file__))
# A model small enough that a world of 4 is larger than some tensors (4 scale groups, 1 mean).
MICRO = qf.LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
)


@pytest.fixture(autouse=True)
def micro_config(monkeypatch):
    """--model micro, for every test; qlora_fsdp's CONFIGS is as it was after each."""
    monkeypatch.setitem(qf.CONFIGS, "micro", MICRO)


def build(args, config, device="cpu"):
    """qf.build as a run builds from the flags `args` (the state sharded over all ranks)."""
    plan = qf.Plan.of(args, qf.world_and_rank()[0])
    return qf.build(config, plan, torch.device(device), None, args.checkpoint)


def unpack_codes(packed):
    return torch.stack([packed >> 4, packed & 0xF], dim=-1).view(-1).long()


# The longest single-process runs (compiling, measuring memory, the GPU check's dry runs) are made
# beside the other tests, which mostly use one core: in one spawned process, started with the
# module's first test, one job after another in the order their tests come, each result saved as
# the job ends. A test waits for its job's result and checks it.

BESIDE = {}  # job name -> (job, the tests or fixtures that read its result)


def beside(*tests):
    """Registers job(folder) to run beside the tests, for the tests (or fixtures) named."""

    def register(job):
        BESIDE[job.__name__] = (job, tests)
        return job

    return register


class JobFailed(NamedTuple):
    traceback: str


def _beside_worker(names, folder):
    torch.set_num_threads(1)  # the other core is the tests'
    qf.CONFIGS["micro"] = MICRO  # as micro_config sets it for every test
    for name in names:
        try:
            result = BESIDE[name][0](folder)
        except BaseException:
            result = JobFailed(traceback.format_exc())
        path = os.path.join(folder, name)
        torch.save(result, path + ".part")
        os.replace(path + ".part", path)


@pytest.fixture(scope="module", autouse=True)
def _beside_process(request, tmp_path_factory):
    """Starts the jobs the selected tests read, if any; stops them at the module's end."""
    selected = {item.originalname for item in request.session.items}
    selected |= {name for item in request.session.items for name in item.fixturenames}
    names = [name for name, (_, tests) in BESIDE.items() if selected & set(tests)]
    if not names:
        yield None, names, None
        return
    folder = str(tmp_path_factory.mktemp("beside"))
    proc = mp.get_context("spawn").Process(target=_beside_worker, args=(names, folder))
    proc.daemon = True
    proc.start()
    # The tests' process takes one thread as well: two OpenMP threads that share a core with the
    # process beside spin while they wait for each other (the suite's CPU time 40% higher).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield proc, names, folder
    torch.set_num_threads(threads)
    if proc.is_alive():
        proc.terminate()
    proc.join()


@pytest.fixture(scope="module")
def beside_result(_beside_process):
    """result(job): the job's result, once the process beside has made it."""
    proc, names, folder = _beside_process

    def result(job):
        assert job.__name__ in names, f"{job.__name__} started for none of the selected tests"
        path = os.path.join(folder, job.__name__)
        deadline = time.monotonic() + 900  # a job that hangs fails its test, not the suite
        while not os.path.exists(path):
            ended = f"the process beside the tests ended (exit code {proc.exitcode})"
            assert proc.is_alive() or os.path.exists(path), f"{ended} before {job.__name__}"
            if time.monotonic() > deadline:
                proc.terminate()  # the jobs after it fail at once too
                pytest.fail(f"{job.__name__}: no result beside the tests in 900 s", pytrace=False)
            time.sleep(0.05)
        out = torch.load(path, weights_only=False)
        if isinstance(out, JobFailed):
            pytest.fail(f"{job.__name__}, beside the tests:\n{out.traceback}", pytrace=False)
        return out

    return result


# ---- 0. the file: each section can be lifted out alone -------------------------------------------


def sections():
    """{number: source} of qlora_fsdp.py's sections, split at their titled banners."""
    parts = re.split(r"\n# -{20,}\n# (\d+)\. [^\n]*\n# -{20,}\n", open(qf.__file__).read())
    return dict(zip(parts[1::2], parts[2::2]))


def needs(body):
    """The clauses of a section's first comment, "# Needs: import a, b; from above: c, d."."""
    assert body.startswith("# Needs: "), body[:80]
    words = []
    for line in body[len("# Needs: ") :].splitlines():
        words.append(line.removeprefix("# ").strip())
        if line.endswith("."):
            break
    return " ".join(words)[:-1].split("; ")


def lifted(numbers):
    """The source of a module made of qlora_fsdp's sections `numbers` alone, each after the
    imports its Needs comment names."""
    parts = sections()
    source = []
    for num in numbers:
        source += [c for c in needs(parts[str(num)]) if c.startswith(("import ", "from "))]
        source = [c for c in source if not c.startswith("from above")]
        source.append(parts[str(num)])
    return "\n".join(source)


def test_each_section_names_what_it_needs():
    """Each section begins with a comment naming what it needs -- imports and names from the
    sections above it, or whole sections ("section 3", "sections 5-10") -- that binds every global
    name the section reads and does not define itself (read from the compiler's symbol tables,
    inside functions too), so that a paste of the section with those imports runs; the names it
    takes from above are defined above it."""
    import builtins
    import symtable

    defined_above = set(
        re.findall(r"^(?:def |class )?(\w+)", open(qf.__file__).read().split("\n# 1. ")[0], re.M)
    )
    owned = {}  # section number -> the names it defines
    for num, body in sections().items():
        ns = {}
        for clause in needs(body):
            if clause.startswith("from above: "):
                names = []
                for item in clause[len("from above: ") :].split(", "):
                    whole = re.fullmatch(r"sections? (\d+)(?:-(\d+))?", item)
                    if whole is None:
                        names.append(item)
                        continue
                    for n in range(int(whole[1]), int(whole[2] or whole[1]) + 1):
                        assert n < int(num), (num, item)
                        names += [name for name in owned[n] if hasattr(qf, name)]
                assert set(names) <= defined_above, (num, set(names) - defined_above)
                ns.update((n, getattr(qf, n)) for n in names)
            elif not clause.startswith("nothing"):
                exec(clause, ns)  # the imports, run
        table, own, read = symtable.symtable(body, f"section {num}", "exec"), set(), set()
        stack = [(table, True)]
        while stack:
            t, top = stack.pop()
            for sym in t.get_symbols():
                if top and (sym.is_assigned() or sym.is_imported() or sym.is_namespace()):
                    own.add(sym.get_name())
                if sym.is_referenced() and (top or sym.is_global()):
                    read.add(sym.get_name())
            stack += [(c, False) for c in t.get_children()]
        missing = {n for n in read - own - set(ns) - set(dir(builtins)) if not n.startswith("__")}
        assert not missing, (num, sorted(missing))
        defined_above |= own
        owned[int(num)] = own


def test_the_tests_follow_the_file():
    """This file has one banner per section of qlora_fsdp.py, in the file's order (after 0, the
    file's own checks), so that each claim's test is found under the section it tests."""
    numbers = re.findall(r"^# ---- (\d+)\. ", open(__file__).read(), re.M)
    assert [int(n) for n in numbers] == list(range(18))


PART_TWO = "\n# Part II"  # the banner's line, where Part II starts


def part_one():
    """The text of qlora_fsdp.py before the `# Part II` banner (its ===== line too)."""
    text = open(qf.__file__).read()
    return text[: text.index(PART_TWO)].rsplit("\n", 1)[0]


def test_part_one_is_the_lesson_and_ends_with_the_loop():
    """The file tells the lesson first: Part I (sections 1-8, in the story's order) ends with the
    training loop, and a `# Part II` banner starts what extends it (sections 9-17); the module
    docstring says so. Part I is at most 1,500 non-blank lines of at most 60 characters on
    average, at least 12% of them comments and docstrings (the explanation is not what made it
    short), with no function over 50 non-blank lines; the whole file is at most 5,420, no
    function over 60 but the flags' (80). (Part I holds the general unit life: its budget is
    1,500. Part II's goal is 3,300 lines and 150 more for tiles, not met: 5,420 holds what the
    file has, so that it does not grow.)"""
    import ast

    text = open(qf.__file__).read()
    lines = text.split("\n")
    part_two = next(i for i, line in enumerate(lines) if line.startswith("# Part II"))
    numbers = [int(n) for n in re.findall(r"^# (\d+)\. ", text, re.M)]
    assert numbers == list(range(1, 18))
    first_of_part_two = next(i for i, line in enumerate(lines) if line.startswith("# 9. "))
    assert part_two < first_of_part_two
    assert "Part I" in qf.__doc__ and "Part II" in qf.__doc__ and "Skip it" in qf.__doc__
    loop = next(i for i, line in enumerate(lines) if line.startswith("def train("))
    assert loop < part_two
    explained = set()  # the lines of docstrings and comments
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and ast.get_docstring(
            node
        ):
            doc = node.body[0]
            explained |= set(range(doc.lineno - 1, doc.end_lineno))
        if isinstance(node, ast.FunctionDef):
            body = lines[node.lineno - 1 : node.end_lineno]
            n = sum(1 for line in body if line.strip())
            limit = 50 if node.lineno < part_two else 60
            limit = 80 if node.name == "_add_flags" else limit
            assert n <= limit, (node.name, n)
    explained |= {i for i, line in enumerate(lines) if line.strip().startswith("#")}
    reference = [i for i in range(part_two) if lines[i].strip()]
    assert len(reference) <= 1500 and sum(1 for line in lines if line.strip()) <= 5420
    assert sum(len(lines[i]) for i in reference) <= 60 * len(reference)
    assert len(explained & set(reference)) >= 0.12 * len(reference)


def test_part_one_names_nothing_of_part_two():
    """No name that Part I reads (at module level, or as a global inside a function or class,
    from the compiler's symbol tables) is defined only after the `# Part II` banner: Part II
    extends Part I, never the reverse."""
    import ast
    import symtable

    text = open(qf.__file__).read()
    first = part_one()
    later = ast.parse(text[len(first) :])
    defined_after = set()
    for node in later.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined_after.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined_after |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined_after |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    top = symtable.symtable(first, "part one", "exec")
    own = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    read = set()
    stack = [(top, True)]
    while stack:
        table, is_top = stack.pop()
        for sym in table.get_symbols():
            if sym.is_referenced() and (is_top or sym.is_global()):
                read.add(sym.get_name())
        stack += [(child, False) for child in table.get_children()]
    assert defined_after - own, "Part II defines names of its own"
    assert not (read & (defined_after - own)), sorted(read & (defined_after - own))


def exec_module(name, source):
    """source run as a module of its own, `name` (its custom ops get that namespace)."""
    module = types.ModuleType(name)
    module.__file__ = qf.__file__
    sys.modules[name] = module  # dataclasses and torch.library look modules up by name
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


# ---- 1. memory accounting ------------------------------------------------------------------------


def test_memory_budget_7b():
    """Full bf16 fine-tuning of Llama-2-7B needs 2 + 2 + 4 bytes/param (~13.5 + 13.5 + 27 GB);
    QLoRA's base is ~0.52 B/param and its adapters ~20 M params at rank 8."""
    counts = qf.count_params(qf.CONFIGS["llama2-7b"], lora_rank=8)
    b = qf.memory_budget(counts)
    n = b.n_params
    assert 6.7e9 < n < 6.8e9  # Llama-2-7B has 6.74 B parameters
    assert b.full_bf16 == (2 * n, 2 * n, 4 * n)  # params, grads, optimizer
    assert 19e6 < b.n_lora < 21e6
    # 0.516 B/param of NF4, bf16 embeddings and lm_head, fp32 adapters; an NF4 head saves 0.2 GB
    assert 3.9e9 < b.qlora.params < 4.0e9
    nf4_head = qf.count_family_params(qf.CONFIGS["llama2-7b"], 8, nf4_head=True)
    assert 3.7e9 < qf.memory_budget(nf4_head).qlora.params < 3.8e9
    assert b.qlora.grads == 4 * b.n_lora and b.qlora.optimizer == 8 * b.n_lora


# Tiny configs of each family, with every delta from Llama that it has.
FAMILIES = {
    "llama": dict(model_type="llama"),
    "llama with biases": dict(model_type="llama", attention_bias=True, mlp_bias=True),
    "mistral": dict(model_type="mistral", head_dim=64, sliding_window=4096),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", head_dim=64),
}


def family_config(family, **changes):
    tiny = qf.as_family(qf.CONFIGS["tiny"])
    return dataclasses.replace(tiny, **{**FAMILIES[family], **changes})


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_count_params_equals_the_model(family, dora):
    """count_family_params gives the parameter counts of a built model of each family (GQA's
    smaller k and v, an explicit head_dim, biases, Qwen3's q_norm and k_norm included): the NF4
    projections, the lm_head, the frozen dense embeddings, norms and biases, the adapters (with
    DoRA, their magnitudes too)."""
    config = family_config(family)
    model = qf.CausalLM(config, dtype=torch.float32, compile=False, dora=dora)
    linear, head, dense, lora = qf.count_family_params(config, lora_rank=8, dora=dora)
    named = list(model.named_parameters())
    assert linear == sum(p.numel() for _, p in named if isinstance(p, qf.NF4Tensor))
    assert head == model.lm_head.weight.numel() and not isinstance(
        model.lm_head.weight, qf.NF4Tensor
    )
    frozen = [p for n, p in named if not isinstance(p, qf.NF4Tensor) and not p.requires_grad]
    assert dense == sum(p.numel() for p in frozen) - head
    assert lora == sum(p.numel() for _, p in named if p.requires_grad)


# ---- 2. NF4 quantization -------------------------------------------------------------------------


def test_codebook():
    """The codebook is the QLoRA paper's 16 NF4 values, ascending, with exact -1, 0 and 1, every one
    rebuilt here as bitsandbytes' create_normal_map builds them: the N(0, 1) quantiles of 8 points
    from 0.9677083 to 0.5 and, negated, of 7, with a 0 between, divided by the largest."""
    assert qf.NF4.dtype == torch.float32 and qf.NF4.shape == (16,)
    assert qf.NF4[0] == -1 and qf.NF4[7] == 0 and qf.NF4[15] == 1
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
    positive = normal.icdf(torch.linspace(0.9677083, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -normal.icdf(torch.linspace(0.9677083, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    torch.testing.assert_close(qf.NF4.double(), values / values.max(), rtol=0, atol=2e-7)


@pytest.mark.parametrize("compile", [False, True])
def test_codes_are_nearest(compile):
    """Every code is the codebook value nearest to w / absmax of its block of 64."""
    w = torch.randn(32, 256)
    packed, *_ = qf.quantize_nf4(w, compile=compile)
    blocks = w.view(-1, 64)
    normalized = (blocks / blocks.abs().amax(1, keepdim=True)).view(-1)
    nearest = (normalized[:, None] - qf.NF4[None, :]).abs().argmin(1)  # brute force reference
    assert torch.equal(unpack_codes(packed), nearest)


def test_nibble_order():
    """Two codes per byte, the first element in the high nibble."""
    w = torch.zeros(1, 64)
    w[0, 0], w[0, 1] = -1.0, 1.0  # codes 0 and 15
    packed, *_ = qf.quantize_nf4(w, compile=False)
    assert packed[0].item() == 0x0F
    assert packed[1].item() == 0x77  # two zeros: code 7 each


def test_bits_per_param():
    """Storage is at most 4.13 bits per parameter (4 + 0.127 from double-quantized scales)."""
    t = qf.to_nf4(torch.randn(4096, 4096, dtype=torch.bfloat16))
    # every inner tensor
    bits = sum(getattr(t, n).nbytes for n in t.__tensor_flatten__()[0]) * 8 / t.numel()
    assert bits <= 4.13 and bits == pytest.approx(qf.NF4_BITS_PER_PARAM, abs=1e-4)
    assert t.packed.dtype == torch.uint8 and t.scale_q.dtype == torch.int8


def test_dequantization_error():
    """On a 4096 x 4096 N(0,1) bf16 weight the relative Frobenius error is about 0.092
    (bitsandbytes and torchao both measure 0.0921)."""
    torch.manual_seed(0)
    w = torch.randn(4096, 4096, dtype=torch.bfloat16)
    err = (qf.to_nf4(w).dequantize(torch.float32) - w.float()).norm() / w.float().norm()
    assert 0.090 < err.item() < 0.094


def test_compiled_equals_eager():
    """The torch.compile'd quantize and dequantize give bit-identical results to eager."""
    w = torch.randn(96, 640, dtype=torch.bfloat16)  # 960 blocks: 4 groups of scales, last partial
    eager = qf.quantize_nf4(w, compile=False)
    compiled = qf.quantize_nf4(w, compile=True)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    d_eager = qf.dequantize_nf4(*eager, dtype=torch.bfloat16, compile=False)
    d_compiled = qf.dequantize_nf4(*eager, dtype=torch.bfloat16, compile=True)
    assert torch.equal(d_eager, d_compiled)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_eager_dequantize_copies_nothing_to_its_device(dtype):
    """Once a device has run an eager dequantize (the codebook copied there once), another copies
    nothing from the host: counted by a dispatch mode on "meta", which stands in for a GPU (a
    device other than the host's, where the eager path runs), beside one deliberate copy that
    shows the mode sees them."""
    parts = [t.to("meta") for t in qf.quantize_nf4(torch.randn(64, 128), compile=False)]
    qf.dequantize_nf4(*parts, dtype=dtype, compile=False)
    with _Crossings() as seen:
        qf.dequantize_nf4(*parts, dtype=dtype, compile=False)
        torch.ones(16).to("meta")  # the one copy the mode must see
    assert len(seen.copies) == 1, seen.copies


def test_one_compile_serves_every_shape():
    """The compiled quantize, dequantize (bf16's kernel and the plain one) and loss kernels,
    once they have run, serve every other weight shape and block count (a 64 x 64 weight with
    one group of scales, a layer's several projection shapes, 1 to 300 rows of logits) without
    compiling again: no kernel gains a compiled graph, and the bits are the eager ones."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as compiled_graphs
    from torch._dynamo.utils import guard_failures

    kernels = [
        qf._quantize_blocks,
        qf._dequantize,
        qf._dequantize_bf16_pairs,
        qf._cross_entropy_rows,
    ]

    def graphs():
        return {k.__name__: len(compiled_graphs(k.__code__)) for k in kernels}

    def run(shape, rows):
        w = torch.randn(shape, dtype=torch.bfloat16)
        nf4 = qf.to_nf4(w, compile=True)
        eager = qf.quantize_nf4(w, compile=False)
        assert all(torch.equal(a, b) for a, b in zip(nf4.inner(), eager))
        for dtype in (torch.bfloat16, torch.float32):
            want = qf.dequantize_nf4(*eager, dtype=dtype, compile=False)
            assert torch.equal(qf.dequantize_nf4(*eager, dtype=dtype, compile=True), want)
        logits, targets = torch.randn(rows, 50), torch.randint(50, (rows,))
        got, _ = qf._cross_entropy_rows_compiled(logits.clone(), targets, True)
        torch.testing.assert_close(got, qf._cross_entropy_rows(logits, targets, True)[0])

    torch.manual_seed(0)
    run((128, 128), 17)  # compiles what this process has not yet
    before = graphs()
    assert all(before.values()), before
    for shape, rows in [((64, 64), 1), ((384, 128), 300), ((128, 384), 5), ((64, 64 * 300), 2)]:
        run(shape, rows)
        why = {k.__name__: guard_failures.get(k.__code__) for k in kernels}
        assert graphs() == before, (shape, rows, graphs(), why)


def _compiled_elsewhere(x):
    return x.sin().sum(dim=0) * 2


def _our_kernel(x):  # the graph of _compiled_elsewhere: the compile caches cannot tell them apart
    return x.sin().sum(dim=0) * 2


def test_a_graph_cached_under_other_settings_brings_no_guards():
    """compile_dynamic's kernel serves 1 row after 17 even where the compile caches already
    hold its graph compiled by a plain torch.compile(dynamic=True), whose guards say 2 <= rows
    (CI's cache held such graphs from an older version): the caches key on the graph, not on
    the size settings, and compile_dynamic's tag keeps those apart."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as compiled_graphs
    from torch._dynamo.utils import guard_failures

    torch.compile(_compiled_elsewhere, dynamic=True)(torch.randn(17, 3))
    kernel = qf.compile_dynamic(_our_kernel)
    for rows in (17, 1):
        x = torch.randn(rows, 3)
        torch.testing.assert_close(kernel(x), _our_kernel(x))
    why = guard_failures.get(_our_kernel.__code__)
    assert len(compiled_graphs(_our_kernel.__code__)) == 1, why


def _allocations(fn):
    """(result, sizes in bytes of every allocation fn makes), from the profiler's allocations."""
    with torch.profiler.profile(profile_memory=True) as prof:
        out = fn()
    return out, [
        e.nbytes()
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.nbytes() > 0
    ]


def test_quantize_chunked_equals_whole(monkeypatch):
    """quantize_nf4, a chunk of blocks at a time (here 35 blocks: 7 chunks, the last partial),
    gives the same codes and scales as in one piece."""
    w = torch.randn(96, 160)
    whole = qf.quantize_nf4(w, compile=False)
    monkeypatch.setattr(qf, "QUANT_CHUNK", 64 * 35)
    for a, b in zip(qf.quantize_nf4(w, compile=False), whole):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_dequantize_chunked_equals_reference(dtype, monkeypatch):
    """--no-compile's dequantize, a chunk of blocks at a time, gives the reference's values bit
    for bit, and allocates nothing larger than its output (no int64 codes, no fp32 copy of the
    weight)."""
    # 7 chunks of 96 x 160 elements, the last partial
    monkeypatch.setattr(qf, "DEQUANT_CHUNK", 64 * 35)
    w = torch.randn(96, 160)
    packed, scale_q, factor, mean = parts = qf.quantize_nf4(w, compile=False)
    out, sizes = _allocations(lambda: qf.dequantize_nf4(*parts, dtype=dtype, compile=False))
    absmax = scale_q.float() / factor[torch.arange(scale_q.numel()) // 256] + mean
    # whole, in one go
    ref = (qf.NF4[unpack_codes(packed)].view(-1, 64) * absmax[:, None]).view(-1).to(dtype)
    assert torch.equal(out, ref)
    assert max(sizes) == out.nbytes, sizes


@pytest.mark.parametrize("shape", [(1, 64), (3, 320), (257, 64), (5, 7, 128)])
def test_padded_scale_groups(shape):
    """Shapes whose block count is not a multiple of 256 quantize their last, partial group of
    scales on its own: every scale is within half an int8 step of the exact absmax, and each
    weight is the codebook value of its code times its block's scale."""
    w = torch.randn(shape)
    packed, scale_q, factor, mean = qf.quantize_nf4(w, compile=False)
    n_blocks = w.numel() // 64
    assert scale_q.numel() == n_blocks and factor.numel() == math.ceil(n_blocks / 256)
    absmax = w.reshape(-1, 64).abs().amax(1)
    group = torch.arange(n_blocks) // 256
    approx = scale_q.float() / factor[group] + mean
    assert torch.all((approx - absmax).abs() <= 0.5 / factor[group] + 1e-6)
    # each group, the partial last one too, by its own largest scale
    for g in range(factor.numel()):
        largest = (absmax - absmax.mean())[group == g].abs().max()  # 0 for a single block
        # equal scales: q = 0, finite
        torch.testing.assert_close(factor[g], 127 / largest.clamp_min(1e-30))
        assert scale_q[group == g].abs().max() == (127 if largest > 0 else 0)
    expected = qf.NF4[unpack_codes(packed)].view(-1, 64) * approx[:, None]
    out = qf.to_nf4(w).dequantize(torch.float32)
    assert out.shape == w.shape
    torch.testing.assert_close(out.view(-1, 64), expected, rtol=1e-6, atol=1e-6)


def test_bad_shape_raises():
    """A tensor whose element count is not a multiple of block_size is refused, saying why."""
    with pytest.raises(ValueError, match="divisible by block_size=64"):
        qf.to_nf4(torch.randn(3, 7))


@pytest.mark.parametrize("compile", [False, True])
def test_constant_and_non_finite_weights(compile, monkeypatch):
    """A constant weight (every block scale equal) gets finite scale factors and dequantizes
    exactly; a weight holding inf or NaN is refused, since through the scales' mean it would spoil
    every block."""
    monkeypatch.setattr(qf, "COMPILE", compile)
    for value in (0.0, 1.0, -0.5):
        w = torch.full((300, 64), value)
        nf4 = qf.to_nf4(w)
        assert nf4.scale_factor.isfinite().all()
        assert torch.equal(nf4.dequantize(torch.float32), w)
    for bad in (float("inf"), float("nan")):
        w[7, 3] = bad
        with pytest.raises(ValueError, match="inf or NaN"):
            qf.to_nf4(w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_dequantize_at_the_default_chunk_allocates_nothing_larger_than_its_output(dtype):
    """With DEQUANT_CHUNK as shipped (larger than this weight), the eager dequantize still takes at
    most half the weight per chunk: no temporary (int32 codes, fp32 values) outgrows the output."""
    parts = qf.quantize_nf4(torch.randn(96, 160), compile=False)
    out, sizes = _allocations(lambda: qf.dequantize_nf4(*parts, dtype=dtype, compile=False))
    assert max(sizes) == out.nbytes, sizes


def test_empty_or_odd_blocks_refused():
    """An empty weight, and an odd block size (two codes share a byte), are refused, saying why."""
    with pytest.raises(ValueError, match="positive number"):
        qf.to_nf4(torch.empty(0, 64))
    with pytest.raises(ValueError, match="even"):
        qf.quantize_nf4(torch.randn(2, 63), block_size=63)


# ---- 3. NF4Tensor --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_nf4_equals_dense(dtype):
    """linear_nf4 and F.linear on an NF4Tensor equal F.linear on the dequantized weight, forward
    and backward."""
    w = qf.to_nf4(torch.randn(96, 128, dtype=dtype))
    dense = w.dequantize()
    x = torch.randn(2, 5, 128, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    ref = F.linear(x_ref, dense)
    g = torch.randn_like(ref)
    ref.backward(g)
    for fn in (qf.linear_nf4, F.linear):
        x.grad = None
        y = fn(x, w)
        assert type(y) is torch.Tensor and y.dtype == dtype
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
        y.backward(g)
        torch.testing.assert_close(x.grad, x_ref.grad)


def test_nf4_tensor_metadata_and_to():
    """NF4Tensor reports the original shape and dtype; .to(dtype) dequantizes; .to(device) (here
    "meta") moves the packed bytes and stays NF4; a clone copies the codes."""
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    t = qf.to_nf4(w)
    assert t.shape == (64, 128) and t.dtype == torch.bfloat16 and isinstance(t, torch.Tensor)
    for dtype in (torch.float32, torch.bfloat16):
        d = t.to(dtype)
        assert type(d) is torch.Tensor and d.dtype == dtype
        assert torch.equal(d, t.dequantize(dtype))
    m = t.to("meta")
    assert (
        isinstance(m, qf.NF4Tensor)
        and m.packed.device.type == "meta"
        and m.packed.dtype == torch.uint8
    )
    c = t.clone()
    assert isinstance(c, qf.NF4Tensor) and torch.equal(c.packed, t.packed)


def test_nf4_save_load_roundtrip(tmp_path):
    """torch.save / torch.load (weights_only) round-trip an NF4Tensor exactly."""
    t = qf.to_nf4(torch.randn(128, 64))
    torch.save({"w": t}, tmp_path / "w.pt")
    u = torch.load(tmp_path / "w.pt")["w"]
    assert isinstance(u, qf.NF4Tensor) and u.shape == t.shape and u.dtype == t.dtype
    for n in qf.NF4Tensor.INNER:
        assert torch.equal(getattr(u, n), getattr(t, n))
    assert torch.equal(u.dequantize(), t.dequantize())


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_dense_weight_enters_nf4_alike_by_every_route(compile, monkeypatch):
    """A dense fp32 weight put into a bf16 NF4 weight -- by copy_, by load_state_dict, and by
    load_state_dict(assign=True) onto a layer built on meta (as from_pretrained loads) -- is
    to_nf4 of the weight in bf16, code for code, with the quantize kernel compiled or eager."""
    monkeypatch.setattr(qf, "COMPILE", compile)
    w = torch.randn(64, 128)
    ref = qf.quantize_nf4(w.to(torch.bfloat16), compile=False)  # the eager reference
    ref = qf.NF4Tensor(ref, w.shape, torch.bfloat16)
    copied = qf.to_nf4(torch.zeros(64, 128, dtype=torch.bfloat16))
    copied.copy_(w)
    loaded = qf.NF4Linear(128, 64)
    loaded.load_state_dict({"weight": w})
    with torch.device("meta"):
        assigned = qf.NF4Linear(128, 64)
    assigned.load_state_dict({"weight": w}, assign=True)
    for t in (copied, loaded.weight, assigned.weight):
        assert isinstance(t, qf.NF4Tensor) and t.dtype == torch.bfloat16
        for n in qf.NF4Tensor.INNER:
            assert torch.equal(getattr(t, n), getattr(ref, n)), n


def test_unsupported_op_names_it():
    """An op NF4Tensor does not implement raises NotImplementedError naming the op."""
    t = qf.to_nf4(torch.randn(64, 64))
    with pytest.raises(NotImplementedError, match="aten.mul"):
        t * 2


def test_ops_keep_block_sizes_and_clone_owns_its_codes():
    """clone, detach and a move keep an NF4Tensor's block sizes (here 32 and 128, not the defaults);
    a clone's codes are its own (zeroing them leaves the original's) and dequantize alike."""
    t = qf.to_nf4(torch.randn(64, 128), block_size=32, scaler_block_size=128)
    for u in (t.clone(), t.detach(), t.to("meta")):
        assert (u.block_size, u.scaler_block_size) == (32, 128)
    c, before = t.clone(), t.packed.clone()
    assert torch.equal(c.dequantize(), t.dequantize())
    c.packed.zero_()
    assert torch.equal(t.packed, before)


def test_linear_with_bias_and_copy_of_another_shape():
    """F.linear(x, nf4_weight, bias) (positional or keyword) equals F.linear on the dequantized
    weight; copy_ from a tensor of another shape (even with as many elements) is refused."""
    w, x, b = qf.to_nf4(torch.randn(96, 128)), torch.randn(3, 128), torch.randn(96)
    assert torch.equal(F.linear(x, w, b), F.linear(x, w.dequantize(), b))
    assert torch.equal(F.linear(x, w, bias=b), F.linear(x, w.dequantize(), b))
    with pytest.raises(ValueError, match="copy_ into"):
        qf.to_nf4(torch.randn(64, 128)).copy_(torch.randn(128, 64))


def has_storage(t):
    """Whether the tensor owns real data (a wrapper subclass has none)."""
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:
        return False
    return True


def test_module_to_keeps_the_weight_packed():
    """Module.to(dtype) and .to(device) on an NF4Linear leave its weight an NF4Tensor with no dense
    storage (the codes unchanged, the dtype reported as asked); before, the cast dequantized a
    dense copy into it, as torchao's does."""
    layer = qf.NF4Linear(64, 32, bias=True, dtype=torch.bfloat16, compile=False)
    packed = layer.weight.packed.clone()
    assert not has_storage(layer.weight)
    for change in (torch.float32, "cpu", torch.bfloat16):
        layer.to(change)
        assert isinstance(layer.weight, qf.NF4Tensor) and not has_storage(layer.weight)
        assert torch.equal(layer.weight.packed, packed)
    layer.float()
    assert layer.weight.dtype == torch.float32 and layer.bias.dtype == torch.float32
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight.dequantize(), layer.bias))


def rss_bytes():
    """This process's resident set now (Linux)."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) * 1024


CONVERSIONS = {  # name: (the conversion, the dtype a bf16 weight reports after it)
    ".to(bf16)": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    ".to(fp16)": (lambda m: m.to(torch.float16), torch.float16),
    ".half()": (lambda m: m.half(), torch.float16),
    ".bfloat16()": (lambda m: m.bfloat16(), torch.bfloat16),
    ".float()": (lambda m: m.float(), torch.float32),
    ".to(cpu)": (lambda m: m.to("cpu"), torch.bfloat16),
    ".cpu()": (lambda m: m.cpu(), torch.bfloat16),
    "_apply(double)": (
        lambda m: m._apply(lambda t: t.double() if t.is_floating_point() else t),
        torch.float64,
    ),
}


SWITCHES = {
    "default": lambda flag: None,
    "overwrite": torch.__future__.set_overwrite_module_params_on_conversion,
    "swap": torch.__future__.set_swap_module_params_on_conversion,
}


@pytest.fixture(scope="module")
def big_nf4_weight():
    """A 4096 x 4096 bf16 weight in NF4 (quantized once: eagerly it takes seconds)."""
    return qf.to_nf4(torch.randn(4096, 4096, dtype=torch.bfloat16), compile=False)


@pytest.mark.parametrize("switch", list(SWITCHES))
@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_module_conversions_keep_an_nf4_weight_packed(conversion, switch, big_nf4_weight):
    """An nn.Linear whose weight is an NF4Tensor (as torchao's tests make one, and as a lifted
    piece has it), converted by nn.Module.to(dtype), .to(device), .half(), .bfloat16(), .float(),
    .cpu() or _apply, with torch's overwrite or swap switch set or not: its weight stays an
    NF4Tensor with no storage of its own, reports the new dtype and dequantizes to that dtype's
    values, the codes unchanged; the process grows by no dense copy (a 4096 x 4096 weight: 32 MiB
    in bf16, 64 MiB in fp32). Before, the cast gave it a dense storage of its full size."""
    linear = torch.nn.Linear(4096, 4096, bias=False, dtype=torch.bfloat16, device="meta")
    linear.weight = torch.nn.Parameter(big_nf4_weight.clone(), requires_grad=False)
    packed = linear.weight.packed.clone()
    before = rss_bytes()
    convert, dtype = CONVERSIONS[conversion]
    SWITCHES[switch](True)
    try:
        convert(linear)
    finally:
        SWITCHES[switch](False)
    grown = rss_bytes() - before
    weight = linear.weight
    assert type(weight) is qf.NF4Tensor and isinstance(weight, torch.nn.Parameter)
    assert not has_storage(weight) and torch.equal(weight.packed, packed)
    assert grown < 16 * 2**20, grown  # a dense copy is 32 MiB or more
    assert weight.dtype == dtype
    # Its first 4,096 values (64 blocks, one group of scales) in the new dtype: the fp32 ones.
    packed, scale_q, factor, mean = weight.inner()
    first = qf.NF4Tensor([packed[:2048], scale_q[:64], factor[:1], mean], (64, 64), dtype)
    fp32 = qf.NF4Tensor(first.inner(), (64, 64), torch.float32)
    values = first.dequantize(compile=False)
    assert values.dtype == dtype and torch.equal(values, fp32.dequantize(compile=False).to(dtype))


def test_converted_modules_save_load_and_copy_without_a_dense_weight(tmp_path):
    """A whole Llama built in fp32 and moved to bf16, and an NF4 nn.Linear after .half(): their
    state_dict, torch.save / torch.load and copy.deepcopy hold NF4 weights with no dense storage,
    which dequantize as before; the Llama runs; .to(dtype) on a weight that is not a module's
    parameter still dequantizes (the API's)."""
    import copy

    model = make_model(dtype=torch.float32)
    ref_logits = model(torch.randint(256, (1, 8)))
    model.to(torch.bfloat16)
    linear = torch.nn.Linear(128, 64, bias=False)
    linear.weight = torch.nn.Parameter(qf.to_nf4(linear.weight.detach()), requires_grad=False)
    linear.half()
    for module in (model, linear):
        weights = [p for p in module.parameters() if isinstance(p, qf.NF4Tensor)]
        assert weights and all(p.dtype != torch.float32 for p in weights)
        torch.save(module.state_dict(), tmp_path / "m.pt")
        for state in (module.state_dict(), torch.load(tmp_path / "m.pt")):
            nf4 = [t for t in state.values() if isinstance(t, qf.NF4Tensor)]
            assert len(nf4) == len(weights) and not any(has_storage(t) for t in nf4)
        twin = copy.deepcopy(module)
        for p, q in zip(weights, (p for p in twin.parameters() if isinstance(p, qf.NF4Tensor))):
            assert not has_storage(q) and torch.equal(q.dequantize(), p.dequantize())
    tokens = torch.randint(256, (1, 8))
    assert model(tokens).dtype == torch.bfloat16 and ref_logits.shape == model(tokens).shape
    w = linear.weight.detach()  # a tensor, not a parameter
    assert type(w.to(torch.float32)) is torch.Tensor


def test_a_sharded_module_converts_without_a_dense_weight():
    """On a model sharded by FSDP, .float(), .to("cpu") and .cpu() leave the NF4 shards as bytes and
    the gathered NF4 weights views of the unit's storage (no storage of their own), and the model
    still gives its losses."""
    model = make_model()
    fsdp = qf.FSDP(model, model.units(), "cpu", torch.float32)
    x, y = torch.randint(256, (2, 16)), torch.randint(256, (2, 16))
    want = model(x, y).item()
    for convert in (lambda m: m.float(), lambda m: m.to("cpu"), lambda m: m.cpu()):
        convert(model)
        unit = fsdp.units[1]
        unit.gather()
        weight = model.model.layers[0].self_attn.q_proj.weight
        assert type(weight) is qf.NF4Tensor and not has_storage(weight)
        assert weight.packed.untyped_storage().data_ptr() == unit.storage.data_ptr()
        unit.free()
        assert all(u.shard_bytes.dtype == torch.uint8 for u in fsdp.all_units)
        assert model(x, y).item() == want


def test_compile_is_nn_modules():
    """NF4Linear.compile is nn.Module.compile (the NF4 kernels' switch is compile_kernels): it
    compiles the layer, which then gives the eager layer's output (dynamo's eager backend)."""
    layer = qf.LoRALinear(64, 32, compile=False)
    torch.nn.init.normal_(layer.lora_B)
    x = torch.randn(3, 64)
    want = layer(x)
    assert type(layer).compile is torch.nn.Module.compile and layer.compile_kernels is False
    layer.compile(backend="eager")
    torch.testing.assert_close(layer(x), want, rtol=0, atol=0)


# ---- 4. LoRA -------------------------------------------------------------------------------------


def test_merged_weight_equals_forward():
    """LoRALinear's forward equals x W'^T with W' = merged_weight() = W + (alpha/rank) B A."""
    layer = qf.LoRALinear(128, 96, rank=4, alpha=8.0, dtype=torch.float32)
    torch.nn.init.normal_(layer.lora_B)
    x = torch.randn(4, 128)
    torch.testing.assert_close(layer(x), x @ layer.merged_weight().T, rtol=1e-5, atol=1e-5)
    assert layer.scaling == 2.0


@pytest.mark.parametrize("bias", [True, False])
def test_from_linear_wraps_the_layer_itself(bias, monkeypatch):
    """NF4Linear.from_linear and LoRALinear.from_linear wrap an existing nn.Linear: the weight is
    its own, quantized (the codes to_nf4 gives it), the bias its own, kept and frozen; the output is
    x W^T + bias with W dequantized (B = 0: LoRA adds nothing yet). NF4Linear's draws nothing from
    the global RNG; with compile=False neither building nor running (bf16) calls a compiled NF4
    kernel."""

    def refuse(*args):
        raise AssertionError("a compiled NF4 kernel ran")

    monkeypatch.setattr(qf, "_quantize_blocks_compiled", refuse)
    monkeypatch.setattr(qf, "_dequantize_bf16_pairs_compiled", refuse)
    linear = torch.nn.Linear(128, 64, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    state = torch.random.get_rng_state()
    plain = qf.NF4Linear.from_linear(linear, compile=False)
    assert torch.equal(torch.random.get_rng_state(), state)
    lora = qf.LoRALinear.from_linear(linear, rank=4, alpha=8.0, compile=False)
    assert lora.rank == 4 and lora.scaling == 2.0 and lora.lora_B.abs().sum() == 0
    # positional too
    assert qf.LoRALinear.from_linear(linear, 4, 8.0, 0.1, compile=False).scaling == 2.0
    codes = qf.to_nf4(linear.weight.detach(), compile=False).packed
    for m in plain, lora:
        assert torch.equal(m.weight.packed, codes) and m.weight.dtype == torch.bfloat16
        assert (m.bias is None) == (not bias)
        assert not bias or (torch.equal(m.bias, linear.bias) and not m.bias.requires_grad)
        ref = x @ m.weight.dequantize(compile=False).T
        assert torch.equal(m(x), ref if linear.bias is None else ref + linear.bias)
    assert [n for n, p in lora.named_parameters() if p.requires_grad] == ["lora_A", "lora_B"]


def test_lora_dropout_a_mask_per_layer():
    """With LoRA dropout, in training each layer's adapter path reads dropout(x) with a mask of its
    own, also where layers share an input (q, k, v), and the base path reads x itself; in eval
    mode nothing is dropped."""
    torch.manual_seed(0)
    layers = [qf.LoRALinear(64, 32, rank=4, dropout=0.5, dtype=torch.float32) for _ in range(3)]
    for m in layers:
        torch.nn.init.normal_(m.lora_B)
    x = torch.randn(5, 64)
    for training in (True, False):
        for m in layers:
            m.train(training)
        torch.manual_seed(1)
        ys = qf.shared_input(x, *layers)
        torch.manual_seed(1)  # the same draws, in the same order: one mask per layer
        for m, y in zip(layers, ys):
            xd = F.dropout(x, 0.5, training=training)
            ref = F.linear(x, m.weight.dequantize()) + m.scaling * F.linear(
                F.linear(xd, m.lora_A), m.lora_B
            )
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_compile_lora_linear_fullgraph():
    """A LoRALinear over NF4 compiles with fullgraph=True; forward and backward equal eager."""
    torch.manual_seed(0)
    layer = qf.LoRALinear(128, 64, rank=4, dtype=torch.float32)
    torch.nn.init.normal_(layer.lora_B)
    x = torch.randn(3, 128)
    compiled = torch.compile(layer, fullgraph=True)
    outs = []
    for fn in (layer, compiled):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, layer.lora_A.grad.clone(), layer.lora_B.grad.clone()))
        layer.zero_grad()
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def saved_weights(fn, weight_shapes):
    """Plain tensors shaped like a base weight (or its transpose, or flat) that autograd saves for
    backward while fn() runs forward and backward."""
    shapes = {tuple(s) for s in weight_shapes} | {tuple(s)[::-1] for s in weight_shapes}
    shapes |= {(math.prod(s),) for s in weight_shapes}
    found = []

    def pack(t):
        if type(t) is torch.Tensor and t.is_floating_point() and tuple(t.shape) in shapes:
            found.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return found


@pytest.mark.parametrize("compile", [False, True])
def test_lora_linear_saves_no_dense_weight(compile):
    """A LoRALinear over NF4, compiled or eager, saves the 4-bit weight for backward, never a
    dense (1536, 512) copy of it (activations here are (3, 5, .): no shape to confuse)."""
    torch.manual_seed(0)
    layer = qf.LoRALinear(512, 1536, dtype=torch.bfloat16)
    x = torch.randn(3, 5, 512, dtype=torch.bfloat16, requires_grad=True)
    fn = torch.compile(layer) if compile else layer
    assert saved_weights(lambda: fn(x).float().sum().backward(), [(1536, 512)]) == []
    assert x.grad is not None and layer.lora_B.grad is not None


def reference_logits(model, tokens):
    """Llama written plainly in fp32 with dense (dequantized) weights, HF's rotate-half RoPE,
    and key/value heads repeated for GQA; the family's deltas as transformers' modeling files
    write them (biases, Qwen3's per-head q_norm and k_norm before RoPE). LoRA terms included, so
    it is the reference either way."""
    c = model.config
    B, T = tokens.shape
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def dense(w):
        return w.dequantize(torch.float32) if isinstance(w, qf.NF4Tensor) else w.float()

    def lin(m, x):
        y = x @ dense(m.weight).T
        if m.bias is not None:
            y = y + m.bias.float()
        if isinstance(m, qf.DoRALinear):  # the bias is outside the magnitude's scale
            return dora_reference(m, x, x)
        if isinstance(m, qf.LoRALinear):
            y = y + m.scaling * (x @ m.lora_A.float().T @ m.lora_B.float().T)
        return y

    def rms(x, w):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w.float()

    def rope(x):  # (B, heads, T, hd)
        inv = 1.0 / c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = (torch.arange(T, dtype=torch.float64)[:, None] * inv[None]).float()
        cos, sin = ang.cos(), ang.sin()
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    h = model.model.embed_tokens.weight.float()[tokens]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for layer in model.model.layers:
        a = layer.self_attn
        x = rms(h, layer.input_layernorm.weight)
        q = lin(a.q_proj, x).view(B, T, nh, hd)
        k = lin(a.k_proj, x).view(B, T, nkv, hd)
        if getattr(c, "model_type", "llama") == "qwen3":
            q = rms(q, a.q_norm.weight)
            k = rms(k, a.k_norm.weight)
        q = rope(q.transpose(1, 2))
        k = rope(k.transpose(1, 2)).repeat_interleave(nh // nkv, 1)
        v = lin(a.v_proj, x).view(B, T, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
        att = (
            (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~mask, float("-inf")).softmax(-1)
        )
        h = h + lin(a.o_proj, (att @ v).transpose(1, 2).reshape(B, T, -1))
        x = rms(h, layer.post_attention_layernorm.weight)
        m = layer.mlp
        h = h + lin(m.down_proj, F.silu(lin(m.gate_proj, x)) * lin(m.up_proj, x))
    return rms(h, model.model.norm.weight) @ dense(model.lm_head.weight).T


def make_model(name="tiny", dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    return qf.Llama(qf.CONFIGS[name], dtype=dtype, **kw)


def test_initial_draws():
    """lora_A fills nn.Linear's kaiming-uniform range, U(-1/sqrt(in), 1/sqrt(in)); the random base
    is N(0, 1/in); seeded keys that join to the same digits ((1, 23) and (12, 3)) draw apart."""
    g = qf.seeded(0, "x")
    a, bound = qf.lora_A_init((64, 1024), g), 1 / math.sqrt(1024)
    assert a.abs().max() <= bound and a.max() > 0.99 * bound and a.min() < -0.99 * bound
    w = qf.random_weight((64, 4096), g)
    assert abs(w.std().item() - 4096**-0.5) < 0.02 * 4096**-0.5
    keys = [(1, 23), (12, 3), (0, "batch", 1, 11), (0, "batch", 11, 1)]
    assert len({tuple(torch.rand(4, generator=qf.seeded(*k)).tolist()) for k in keys}) == 4


# ---- 5. sharding and offload: the unit life (spawned gloo processes) -----------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, args, nprocs):
    """Ranks start from a forkserver that has imported torch, this file and torch.compile's
    machinery (which qlora_fsdp imports at its first use) once: a rank costs a fork, not a fresh
    interpreter's imports. (The preload list matters only when the forkserver starts; the
    process-wide setting is put back after.)"""
    from multiprocessing import forkserver

    saved = forkserver._forkserver._preload_modules
    mp.set_forkserver_preload([__name__, "torch._dynamo", "torch._inductor.compile_fx"])
    try:
        mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
    finally:
        mp.set_forkserver_preload(saved)


def _become_rank(rank, world, port):
    """A spawned process set up as torchrun sets up rank `rank` of `world` (one thread, and the
    tests' micro config: no fixture runs here)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    qf.CONFIGS["micro"] = MICRO


def _worker(rank, world, port, argv, out_path):
    _become_rank(rank, world, port)
    summary, losses, fsdp = qf.fine_tune(qf.parse_args(argv))
    adapters = fsdp.full_adapters()
    shard_sizes = {
        s.name: max(0, min(s.shard_numel, s.numel - rank * s.shard_numel))
        for u in fsdp.units
        for s in u.slots
    }
    padding = [
        u.master.data[s.start + shard_sizes[s.name] : s.start + s.shard_numel].abs().sum()
        for u in fsdp.units
        for s in u.adapters
    ]  # flat master's padding: must stay 0
    result = dict(
        summary=summary,
        losses=losses,
        adapters=adapters,
        local_bytes=fsdp.local_bytes(),
        local_master_bytes=[u.master.nbytes for u in fsdp.trained],
        shard_sizes=shard_sizes,
        padding_sum=float(sum(padding)),
        padding_numel=sum(
            s.shard_numel - shard_sizes[s.name] for u in fsdp.units for s in u.adapters
        ),
    )
    torch.save(result, f"{out_path}.{rank}")
    torch.distributed.destroy_process_group()


def run_sharded(world, argv, tmp_path):
    out = str(tmp_path / f"ws{world}")
    spawn(_worker, (world, free_port(), argv, out), world)
    return [torch.load(f"{out}.{r}") for r in range(world)]


def run_single(argv):
    summary, losses, fsdp = qf.fine_tune(qf.parse_args(argv))
    return dict(losses=losses, adapters=fsdp.full_adapters(), local_bytes=fsdp.local_bytes())


def batch_of(data, step, micro, args, world, rank, vocab_size):
    """This rank's micro-batch `micro` of `step`, as the command line's loop takes it."""
    return qf.step_batches(data, step, args, world, rank, vocab_size)[micro]


def train_lesson(argv):
    """The losses of Part I alone (its text run as a module of its own) training by `argv`."""
    lesson = exec_module("qlora_lesson", part_one())
    assert not hasattr(lesson, "FSDP") and not hasattr(lesson, "CausalLM")
    args = qf.parse_args(argv)  # any object with the fields the lesson reads
    device, world, rank = lesson.init_distributed(False)
    config = lesson.LlamaConfig(**dataclasses.asdict(MICRO))
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in lesson.Llama(config).named_parameters()}
    weights = dict(qf.initial_weights(shapes, args.seed))  # what the whole file draws
    model, fsdp = lesson.build_sharded(config, args, device, weights)
    optimizer = lesson.ForeachAdamW(
        fsdp.parameters(), lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay
    )
    data = np.memmap(qf.__file__, dtype=np.uint8, mode="r")  # the default data: the file's bytes
    records = lesson.train(model, fsdp, optimizer, data, args, device)
    return [r.loss for r in records]


def _lesson_worker(rank, world, port, argv, out_path):
    """A rank that trains with Part I alone."""
    _become_rank(rank, world, port)
    torch.save(train_lesson(argv), f"{out_path}.{rank}")
    torch.distributed.destroy_process_group()


def test_part_one_runs_alone_and_equals_the_whole_file(whole_file_micro, tmp_path):
    """Part I's text, run as a module of its own in which no Part II name exists, trains a small
    Llama on 2 gloo ranks (its FullyShard, ForeachAdamW, plain kernels), with the losses of the
    whole file's default path (FSDP, AdamW, q, k and v sharing x A^T) on the same weights, seed
    and data, to fp32's rounding (1e-5; Adam's eps of 1, as BASE's, keeps rounding noise from
    being amplified into a different update)."""
    out = str(tmp_path / "lesson")
    spawn(_lesson_worker, (2, free_port(), LESSON, out), 2)
    lesson = [torch.load(f"{out}.{r}") for r in range(2)]
    assert lesson[0] == lesson[1]
    want = torch.tensor(whole_file_micro[0]["losses"])
    torch.testing.assert_close(torch.tensor(lesson[0]), want, rtol=1e-5, atol=1e-5)


@beside("test_part_one_compiled_runs_alone_and_equals_the_whole_file")
def part_one_compiled(folder):
    argv = [a for a in LESSON if a != "--no-compile"] + ["--compile", "--batch_size", "4"]
    return train_lesson(argv)


def test_part_one_compiled_runs_alone_and_equals_the_whole_file(whole_file_micro, beside_result):
    """Part I alone, compiled (its blocks, and its NF4 and loss kernels as custom ops in a
    namespace of their own), trains in one process with the losses of the whole file's eager run
    on 2 ranks of half the batch (compiled blocks equal eager ones to fp32's rounding)."""
    want = torch.tensor(whole_file_micro[0]["losses"])
    got = torch.tensor(beside_result(part_one_compiled))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# Adam divides each gradient by its own magnitude, so an element whose gradient is rounding noise
# would still move by ~lr, differently in two runs that sum in another order. With eps = 1 the
# update is ~lr * gradient (|g| << 1): the comparison is of the sharded gradients, not of the
# signs of noise. (That our AdamW is torch's is tested on its own above.)
BASE = [
    "--device",
    "cpu",
    "--dtype",
    "fp32",
    "--no-compile",
    "--seq_len",
    "32",
    "--steps",
    "4",
    "--lr",
    "2",
    "--warmup_steps",
    "1",
    "--log_every",
    "100",
    "--adam_eps",
    "1",
]


LESSON = BASE + ["--model", "micro", "--batch_size", "2", "--steps", "3"]


@pytest.fixture(scope="module")
def whole_file_micro(tmp_path_factory):
    """The whole file's eager run of LESSON on 2 gloo ranks."""
    return run_sharded(2, LESSON, tmp_path_factory.mktemp("whole"))


def assert_same_run(sharded, single):
    # Sums run in another order across ranks (~1e-7 relative); a sharding bug moves weights by
    # about one update (~1e-2).
    torch.testing.assert_close(
        torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-5
    )
    assert sharded["adapters"].keys() == single["adapters"].keys()
    for k, v in single["adapters"].items():
        torch.testing.assert_close(sharded["adapters"][k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def single_run_tiny():
    return run_single(BASE + ["--batch_size", "6"])


class CheckpointAround(torch.nn.Module):
    """A block checkpointed from outside its module call, so that the recompute in backward runs
    the unit's forward hooks a second time."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, cos, sin, _, mask=None):
        return torch.utils.checkpoint.checkpoint(
            self.layer, x, cos, sin, False, mask, use_reentrant=False
        )


def test_full_base_gathers_one_unit_at_a_time():
    """At world 1 every shard is its whole tensor (a frozen one padded to 16 bytes, no more);
    full_base() streams the frozen weights, each equal to the module's before sharding, with one
    unit gathered at a time and none after."""
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    fsdp = qf.FSDP(model, model.units(), "cpu", torch.float32)
    for s in (s for u in fsdp.units for s in u.slots):
        padded = -(-s.numel * s.dtype.itemsize // 16) * 16 // s.dtype.itemsize  # to 16 bytes
        assert s.shard_numel == (s.numel if s.trainable else padded), s.name
    names = []
    for name, t in fsdp.full_base():
        gathered = [
            u for u in fsdp.units if any(s.full.untyped_storage().nbytes() for s in u.slots)
        ]
        assert len(gathered) == 1, name
        dense = (
            (lambda w: w.dequantize(torch.float32))
            if isinstance(t, qf.NF4Tensor)
            else (lambda w: w)
        )
        assert torch.equal(dense(t), dense(before[name])), name
        names.append(name)
    assert names == list(before) and all(
        s.full.untyped_storage().nbytes() == 0 for u in fsdp.units for s in u.slots
    )


@pytest.mark.parametrize("checkpointing", ["inside", "around", "off"])
def test_unit_lifecycle_one_collective_each(checkpointing, monkeypatch):
    """Each unit is gathered by ONE all-gather before its forward and freed after it (the last
    unit, needed at once by backward, stays); backward gathers each block once more and
    reduce-scatters its adapter gradients once; afterwards nothing stays gathered. Checkpointing
    inside the block (as Llama does), around the module call (its hooks run again in backward's
    recompute), or off."""
    model = make_model()
    model.checkpointing = checkpointing == "inside"
    calls, real = {"all_gather": 0, "reduce_scatter": 0}, qf._collective

    def counted(*a, reduce_scatter=False, **k):
        calls["reduce_scatter" if reduce_scatter else "all_gather"] += 1
        return real(*a, reduce_scatter=reduce_scatter, **k)

    monkeypatch.setattr(qf, "_collective", counted)
    fsdp = qf.FSDP(model, model.units(), "cpu", torch.float32)
    if checkpointing == "around":
        model.model.layers = torch.nn.ModuleList(
            CheckpointAround(layer) for layer in model.model.layers
        )
    x, y = torch.randint(256, (2, 16)), torch.randint(256, (2, 16))
    ref = make_model()  # the same weights, unsharded
    ref.checkpointing = checkpointing != "off"
    ref_loss = ref(x, y)
    ref_loss.backward()
    loss = model(x, y)
    n_layers = len(model.model.layers)
    assert calls["all_gather"] == n_layers + 2
    gathered = [
        u.name for u in fsdp.units if any(s.full.untyped_storage().nbytes() for s in u.slots)
    ]
    assert gathered == ["model.norm+lm_head"]
    loss.backward()
    assert calls == {"all_gather": 2 * n_layers + 2, "reduce_scatter": n_layers}
    assert all(s.full.untyped_storage().nbytes() == 0 for u in fsdp.units for s in u.slots)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    grads = {name: p.grad[: p.numel()] for name, p in fsdp.named_parameters()}
    for name, p in ref.named_parameters():
        if p.requires_grad:  # world 1: the shard is the whole tensor
            torch.testing.assert_close(
                grads[name].view(p.shape), p.grad, rtol=1e-5, atol=1e-7, msg=name
            )


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_every_piece_starts_aligned_at_any_world_size(model):
    """In a block unit's shard bytes, at every world size 1-8 and in bf16 and fp32, each frozen
    piece starts 16-byte aligned and every piece aligned for its dtype (an fp32 piece after
    odd-sized bf16 ones used to make the unit's construction fail at worlds 3, 5, 6, 7)."""
    for world in range(1, 9):
        for dtype in (torch.bfloat16, torch.float32):
            layer_kw = dict(rank=8, alpha=16.0, dropout=0.0, dtype=dtype, compile=False)
            layer = qf.LlamaDecoderLayer(qf.CONFIGS[model], layer_kw)
            slots = []
            for name, p in layer.named_parameters():
                inner = p.__tensor_flatten__()[0] if isinstance(p, qf.NF4Tensor) else [None]
                for part in inner:
                    t = p if part is None else getattr(p, part)
                    wire = dtype if part is None else t.dtype
                    slots.append(qf._Slot(name, t, wire, p.requires_grad, world, world - 1))
            offset = 0
            for s in sorted(slots, key=qf._layout_order):
                assert offset % (s.dtype.itemsize if s.trainable else 16) == 0, (world, s.name)
                offset += s.nbytes


def test_gather_copies_out_and_reduce_scatter_builds_its_input_in_a_few_ops(monkeypatch):
    """Per unit, the copy-out from the all-gather buffer is at most 3 tensor ops, and so is the
    building of the reduce-scatter's input, whatever the number of tensors in the unit (a block has
    dozens): one split_with_sizes_copy, one _chunk_cat (views not counted; the profiler's op events,
    not kernels)."""
    real = qf._collective

    # the collective itself (here a copy: no process group) is not the input
    def collective(*args, **kwargs):
        with torch.profiler.record_function("collective"):
            return real(*args, **kwargs)

    monkeypatch.setattr(qf, "_collective", collective)
    model = make_model()
    fsdp = qf.FSDP(model, model.units(), "cpu", torch.float32)
    views = {
        "aten::view",
        "aten::reshape",
        "aten::as_strided",
        "aten::slice",
        "aten::_reshape_alias",
        "aten::alias",
    }
    with torch.profiler.profile() as prof:
        model(torch.randint(256, (2, 16)), torch.randint(256, (2, 16))).backward()
    counted = {}
    for e in prof.events():
        if e.name in ("fsdp::copy_out", "fsdp::reduce_scatter"):
            ops = [
                c.name
                for c in e.cpu_children
                if c.name.startswith("aten::") and c.name not in views
            ]
            counted.setdefault(e.name, []).append(len(ops))
    n_tensors = len(fsdp.units[1].slots)
    assert n_tensors > 40 and len(counted["fsdp::copy_out"]) >= 2 * len(model.model.layers)
    assert len(counted["fsdp::reduce_scatter"]) == len(model.model.layers)
    assert max(counted["fsdp::copy_out"]) <= 3 and max(counted["fsdp::reduce_scatter"]) <= 3, (
        counted
    )


def test_clip_grad_norm_equals_torch():
    """FSDP.clip_grad_norm_ returns the L2 norm of all adapter gradients and, above max_norm,
    scales them as torch.nn.utils.clip_grad_norm_ does; below it they stay as they are."""
    fsdp = qf.FSDP(model := make_model(), model.units(), "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    for max_norm in (0.5, 1e9):
        ref = [torch.zeros_like(p, requires_grad=True) for p in fsdp.parameters()]
        for p, r in zip(fsdp.parameters(), ref):
            p.grad = torch.randn(p.shape, generator=g)
            r.grad = p.grad.clone()
        total = fsdp.clip_grad_norm_(max_norm).item()  # a tensor, as torch's
        expected = torch.nn.utils.clip_grad_norm_(ref, max_norm).item()
        assert total == pytest.approx(expected, rel=1e-6) and (total > max_norm) == (
            max_norm == 0.5
        )
        for p, r in zip(fsdp.parameters(), ref):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)


class Int8Tensor(torch.Tensor):
    """A second weight format, defined here and unknown to qlora_fsdp: int8 codes with one fp32
    scale per row, a wrapper subclass with __tensor_flatten__ like NF4Tensor."""

    @staticmethod
    def __new__(cls, q, scale, shape, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=q.device)

    def __init__(self, q, scale, shape, dtype):
        self.q, self.scale = q, scale

    @staticmethod
    def quantize(w):
        scale = w.abs().amax(1).clamp_min(1e-12) / 127
        return Int8Tensor((w / scale[:, None]).round().to(torch.int8), scale, w.shape, w.dtype)

    def dense(self):
        return (self.q.float() * self.scale[:, None]).to(self.dtype)

    def __tensor_flatten__(self):
        return ["q", "scale"], (tuple(self.shape), self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Int8Tensor(inner["q"], inner["scale"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            t = args[0]
            return Int8Tensor(t.q.detach(), t.scale.detach(), t.shape, t.dtype)
        raise NotImplementedError(func)


class Int8LoRA(torch.nn.Module):
    """A frozen Int8Tensor weight (5 x 5: 25 int8 codes and 5 fp32 scales do not split evenly
    over 2 or 3 ranks) and a trainable low-rank update."""

    def __init__(self, g):
        super().__init__()
        self.weight = torch.nn.Parameter(
            Int8Tensor.quantize(torch.randn(5, 5, generator=g)), requires_grad=False
        )
        self.lora_A = torch.nn.Parameter(torch.randn(2, 5, generator=g))
        self.lora_B = torch.nn.Parameter(torch.randn(5, 2, generator=g))

    def forward(self, x):
        return F.linear(x, self.weight.dense()) + x @ self.lora_A.T @ self.lora_B.T


def int8_model():
    g = torch.Generator().manual_seed(0)
    return torch.nn.Sequential(Int8LoRA(g), torch.nn.Tanh(), Int8LoRA(g)).requires_grad_(False)


def int8_grads(rank, world):
    """Adapter gradients of the int8 model sharded over `world` ranks, on rank's quarter of a
    batch of 6 (world 1: the whole batch), gathered in full."""
    model = int8_model()
    for m in model[0], model[2]:
        m.lora_A.requires_grad_(True)
        m.lora_B.requires_grad_(True)
    fsdp = qf.FSDP(model, [model[0], model[2]], "cpu", torch.float32)
    # rebuilt from the shards
    assert all(type(fsdp.param_of[f"{i}.weight"][1].value) is Int8Tensor for i in (0, 2))
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))[
        rank * 6 // world : (rank + 1) * 6 // world
    ]
    model(x).square().sum().mul(world / 6).backward()  # mean over the global batch, as AVG reduces
    return fsdp.full_adapters(of=lambda master: master.grad)


def _int8_worker(rank, world, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.save(int8_grads(rank, world), f"{out_path}.{rank}")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_any_tensor_subclass(world, tmp_path):
    """The sharding knows no weight format: a tensor subclass it has never seen (int8 codes with
    per-row scales) is split through __tensor_flatten__ and rebuilt through
    __tensor_unflatten__, and at world sizes 1, 2 and 3 the adapters' gradients equal the
    unsharded model's."""
    ref = int8_model()
    for m in ref[0], ref[2]:
        m.lora_A.requires_grad_(True)
        m.lora_B.requires_grad_(True)
    ref(torch.randn(6, 5, generator=torch.Generator().manual_seed(1))).square().sum().div(
        6
    ).backward()
    if world == 1:
        results = [int8_grads(0, 1)]
    else:
        out = str(tmp_path / "int8")
        spawn(_int8_worker, (world, free_port(), out), world)
        results = [torch.load(f"{out}.{r}") for r in range(world)]
    for grads in results:
        for i in (0, 2):
            for n in ("lora_A", "lora_B"):
                torch.testing.assert_close(
                    grads[f"{i}.{n}"], getattr(ref[i], n).grad, rtol=1e-5, atol=1e-6
                )


class Block(torch.nn.Module):
    """A residual block that is not Llama's: an nn.LayerNorm, nn.Linear layers with and without a
    bias, a keyword argument, a tuple out."""

    def __init__(self, d, bias):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up, self.down = (
            torch.nn.Linear(d, 2 * d, bias=bias),
            torch.nn.Linear(2 * d, d, bias=not bias),
        )

    def forward(self, x, scale=1.0):
        h = self.down(F.gelu(self.up(self.norm(x))))
        return x + scale * h, h.float().square().mean()


class Net(torch.nn.Module):
    """Embeddings, three Blocks (the last one run twice), a trainable plain parameter in the root, a
    head."""

    def __init__(self, vocab=64, d=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d, bias=i % 2 == 0) for i in range(3))
        self.gain = torch.nn.Parameter(torch.ones(d))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens, targets):
        h, aux = self.embed(tokens), 0.0
        for block in [*self.blocks, self.blocks[-1]]:
            h, a = block(h, scale=0.5)
            aux = aux + a
        return (
            F.cross_entropy(self.head(h * self.gain).flatten(0, 1).float(), targets.flatten())
            + 0.1 * aux
        )


def qlora_net(cls=qf.LoRALinear):
    """Net (fp32) with every nn.Linear a LoRALinear.from_linear (or cls's) of itself; embeddings
    and LayerNorms frozen."""
    torch.manual_seed(0)
    net = Net()
    for m in list(net.modules()):
        for name, child in list(m.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(m, name, cls.from_linear(child, rank=4, alpha=8.0, compile=False))
    net.embed.requires_grad_(False)
    for b in net.blocks:
        b.norm.requires_grad_(False)
    return net


def run_net(net, optimizer, rank=0, world=1, micro=True, n=6):
    """3 AdamW steps over a global batch of n sequences (this rank's rows; with micro, in two
    backward() calls), a no-grad forward before each step and after it, and a block called alone ->
    [losses per step]."""
    g, out = torch.Generator().manual_seed(1), []
    mean = (
        (lambda t: t) if world == 1 else lambda t: (torch.distributed.all_reduce(t), t / world)[1]
    )
    for _ in range(3):
        tokens, targets = torch.randint(64, (2, n, 8), generator=g)[
            :, rank * n // world : (rank + 1) * n // world
        ]
        loss = 0.0
        for rows in (slice(0, 1), slice(1, None)) if micro else (slice(None),):
            part = net(tokens[rows], targets[rows]) * len(tokens[rows]) / len(tokens)
            part.backward()
            loss = loss + part.detach()
        with torch.no_grad():
            before = net(tokens, targets)
            optimizer.step()
            optimizer.zero_grad()
            after, alone = (
                net(tokens, targets),
                net.blocks[1](net.embed(tokens), scale=2.0)[0].float().mean(),
            )
        out.append([mean(t.float()).item() for t in (loss, before, after, alone)])
    return out


def sharded_net(rank, world, compute_dtype, replicas=1):
    net = qlora_net()
    mesh = None
    if replicas > 1:  # HSDP: a 2-D mesh, as fully_shard takes one
        from torch.distributed.device_mesh import init_device_mesh

        names = ("dp_replicate", "dp_shard")
        mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=names)
    units = [net.embed, *net.blocks, net.head]
    fsdp = qf.FSDP(net, units, device="cpu", compute_dtype=compute_dtype, mesh=mesh)
    optimizer = qf.AdamW(fsdp.parameters(), lr=0.05, eps=1e-4, weight_decay=0.1)
    losses = run_net(net, optimizer, rank, world, n=8 if replicas > 1 else 6)
    return losses, fsdp.full_adapters()


def _net_worker(rank, world, port, compute_dtype, out_path, replicas=1):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.save(sharded_net(rank, world, compute_dtype, replicas), f"{out_path}.{rank}")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    "world,compute_dtype,replicas",
    [(1, None, 1), (2, None, 1), (3, None, 1), (2, torch.bfloat16, 1), (4, None, 2)],
    ids=["world1", "world2", "world3", "world2-bf16", "2x2"],
)
def test_any_model_sharded_equals_it_unsharded(world, compute_dtype, replicas, tmp_path):
    """FSDP lifts out of Llama: a model of its own (residual blocks with nn.LayerNorm, from_linear
    LoRA layers with and without a bias, a trainable parameter in the root, a keyword argument and a
    tuple out, one block run twice, one called alone), sharded over 1, 2 and 3 ranks (and 2 x 2,
    hybrid, over 8 rows) with two
    backward() calls per step and no-grad forwards before and after each optimizer step, gives the
    losses and adapters of the same model unsharded under torch.optim.AdamW; in bf16 (every
    parameter gathered in it, the fp32 LayerNorm too) its losses are within 1% (or 1e-3) of them."""
    ref = qlora_net()
    trainable = [p for p in ref.parameters() if p.requires_grad]
    torch_adamw = torch.optim.AdamW(trainable, lr=0.05, eps=1e-4, weight_decay=0.1)
    want = run_net(ref, torch_adamw, micro=False, n=8 if replicas > 1 else 6)
    if world == 1:
        results = [sharded_net(0, 1, compute_dtype)]
    else:
        out = str(tmp_path / "net")
        spawn(_net_worker, (world, free_port(), compute_dtype, out, replicas), world)
        results = [torch.load(f"{out}.{r}") for r in range(world)]
    for losses, adapters in results:
        assert adapters.keys() == {n for n, p in ref.named_parameters() if p.requires_grad}
        if compute_dtype:  # Adam's steps on bf16 gradients may point elsewhere: the losses only
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(want), rtol=1e-2, atol=1e-3
            )
            continue
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)
        for name, p in ref.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(
                    adapters[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name
                )


def test_sections_2_to_4_lift_into_a_model_of_your_own():
    """Sections 2-4 pasted alone into a module of their own, with only the imports their Needs
    comments name, beside qlora_fsdp itself (their custom ops get the module's namespace):
    they quantize a weight as qlora_fsdp does, and their LoRALinear.from_linear wraps a model
    that is not Llama, equal to qlora_fsdp's layers, and trains it under torch.optim.AdamW."""
    nf4_lora = exec_module("lifted_nf4_lora", lifted([2, 3, 4]))
    assert not hasattr(nf4_lora, "Llama") and not hasattr(nf4_lora, "FullyShard")
    w = torch.randn(128, 64)
    for name, ours in zip(qf.NF4Tensor.INNER, nf4_lora.to_nf4(w, compile=False).inner()):
        assert torch.equal(ours, getattr(qf.to_nf4(w, compile=False), name)), name
    torch.manual_seed(0)
    net = Net()
    for m in list(net.modules()):
        for name, child in list(m.named_children()):
            if isinstance(child, torch.nn.Linear):
                mine = nf4_lora.LoRALinear.from_linear(child, rank=4, alpha=8.0, compile=False)
                theirs = qf.LoRALinear.from_linear(child, rank=4, alpha=8.0, compile=False)
                with torch.no_grad():
                    theirs.lora_A.copy_(mine.lora_A)
                    theirs.lora_B.normal_()
                    mine.lora_B.copy_(theirs.lora_B)
                x = torch.randn(3, child.in_features)
                assert torch.equal(mine(x), theirs(x))
                torch.nn.init.zeros_(mine.lora_B)  # the model starts as the base
                setattr(m, name, mine)
    net.embed.requires_grad_(False)
    for b in net.blocks:
        b.norm.requires_grad_(False)
    trainable = [p for p in net.parameters() if p.requires_grad]
    assert len(trainable) == 1 + 2 * 7  # gain, lora_A and lora_B of 6 block layers and the head
    optimizer = torch.optim.AdamW(trainable, lr=0.05)
    tokens, targets = torch.randint(64, (2, 4, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(5):
        loss = net(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def test_dora_lifts_out_with_sections_2_to_4():
    """Section 11's DoRA block (from its comment to dora_magnitudes), pasted after sections 2-4
    alone, makes a DoRALinear over a model's nn.Linear equal to qlora_fsdp's: its output and the
    gradients of x, A, B and m."""
    text = open(qf.__file__).read()
    block = text[text.index("# DoRA (Liu et al. 2024)") : text.index("def _add_bias(")]
    lifted_dora = exec_module("lifted_dora", lifted([2, 3, 4]) + "\n" + block)
    assert not hasattr(lifted_dora, "Llama") and not hasattr(lifted_dora, "FSDP")
    linear = torch.nn.Linear(128, 96)
    x = torch.randn(3, 5, 128)
    outs = []
    for cls in (lifted_dora.DoRALinear, qf.DoRALinear):
        torch.manual_seed(0)
        layer = cls.from_linear(linear, rank=4, alpha=8.0, compile=False)
        with torch.no_grad():
            layer.lora_B.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        outs.append(dora_outputs(layer, layer, x))
    for name, a, b in zip(["y", "x", "A", "B", "m"], *outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_sections_5_and_6_alone_shard_a_model_of_your_own():
    """Sections 5 and 6 alone, pasted with their imports, shard a model that is not Llama (blocks
    taking keywords and returning tuples, a block called alone, no-grad forwards, two backward()
    calls a step) with FullyShard, its unit life the same as FSDP's, and ForeachAdamW trains it
    as torch.optim.AdamW trains it unsharded: the same losses and adapters."""
    sharding = exec_module("lifted_sharding_alone", lifted([5, 6]))
    assert not hasattr(sharding, "FSDP") and not hasattr(sharding, "LoRALinear")
    ref = qlora_net()
    trainable = [p for p in ref.parameters() if p.requires_grad]
    torch_adamw = torch.optim.AdamW(trainable, lr=0.05, eps=1e-4, weight_decay=0.1)
    want = run_net(ref, torch_adamw)
    net = qlora_net()
    fsdp = sharding.FullyShard(net, [net.embed, *net.blocks, net.head], "cpu")
    optimizer = sharding.ForeachAdamW(fsdp.parameters(), lr=0.05, eps=1e-4, weight_decay=0.1)
    losses = run_net(net, optimizer)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)
    pieces = dict(fsdp.named_parameters())
    for name, p in ref.named_parameters():
        if p.requires_grad:  # at world 1 a piece is its whole tensor, flat
            piece = pieces[name][: p.numel()].view(p.shape)
            torch.testing.assert_close(piece, p.detach(), rtol=1e-5, atol=1e-6)


def test_sections_5_6_and_10_lift_into_a_model_of_your_own():
    """Sections 5 and 6 with section 10 (FSDP for any model, AdamW as a drop-in), pasted alone
    with their imports, shard a model that is not Llama and train it as qlora_fsdp's FSDP does:
    the losses and adapters of the same model unsharded under torch.optim.AdamW."""
    sharding = exec_module("lifted_sharding", lifted([5, 6, 10]))
    assert not hasattr(sharding, "LoRALinear") and not hasattr(sharding, "Llama")
    ref = qlora_net()
    trainable = [p for p in ref.parameters() if p.requires_grad]
    torch_adamw = torch.optim.AdamW(trainable, lr=0.05, eps=1e-4, weight_decay=0.1)
    want = run_net(ref, torch_adamw, micro=False)
    net = qlora_net()
    fsdp = sharding.FSDP(net, [net.embed, *net.blocks, net.head], device="cpu")
    optimizer = sharding.AdamW(fsdp.parameters(), lr=0.05, eps=1e-4, weight_decay=0.1)
    losses = run_net(net, optimizer)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)
    adapters = fsdp.full_adapters()
    for name, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(adapters[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_dora_in_a_model_of_your_own_sharded_equals_it_unsharded():
    """DoRALinear.from_linear over the linears of a model that is not Llama (blocks taking keyword
    arguments and returning tuples, a block called alone), sharded by FSDP and stepped by AdamW,
    trains as the same model unsharded under torch.optim.AdamW: losses, adapters and magnitudes
    (which move)."""
    ref = qlora_net(qf.DoRALinear)
    start = {n: p.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    trainable = [p for p in ref.parameters() if p.requires_grad]
    torch_adamw = torch.optim.AdamW(trainable, lr=0.05, eps=1e-4, weight_decay=0.1)
    want = run_net(ref, torch_adamw, micro=False)
    net = qlora_net(qf.DoRALinear)
    fsdp = qf.FSDP(net, [net.embed, *net.blocks, net.head], device="cpu")
    optimizer = qf.AdamW(fsdp.parameters(), lr=0.05, eps=1e-4, weight_decay=0.1)
    losses = run_net(net, optimizer)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)
    adapters = fsdp.full_adapters()
    magnitudes = [n for n in start if n.endswith("lora_magnitude_vector")]
    assert magnitudes and adapters.keys() == start.keys()
    for name, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(adapters[name], p.detach(), rtol=1e-5, atol=1e-6)
    for name in magnitudes:
        assert (adapters[name] - start[name]).abs().max() > 1e-3, name


def test_a_parameter_in_two_units_is_refused():
    """A parameter in two units (a head tied to the embeddings, each its own unit) is refused at
    construction, naming both places."""
    net = qlora_net()
    net.head = torch.nn.Linear(64, 64, bias=False)
    net.head.weight = net.embed.weight
    with pytest.raises(
        ValueError, match="parameter head.weight \\(also embed.weight\\) is in two units"
    ):
        qf.FSDP(net, [net.embed, *net.blocks, net.head], device="cpu")


def test_a_unit_outside_the_model_is_refused():
    """A unit that is not a submodule of the model is refused at construction."""
    net = qlora_net()
    with pytest.raises(ValueError, match="a unit's Linear is not a submodule of the model"):
        qf.FSDP(net, [net.embed, torch.nn.Linear(64, 64)], device="cpu")


def test_a_sharded_parameter_outside_its_unit_is_a_clear_error():
    """A unit's parameter read outside its forward is an AttributeError that names it (its storage
    is empty then: reading it used to crash the process); inside, it is the full tensor."""
    net = qlora_net()
    fsdp = qf.FSDP(net, [net.embed, *net.blocks, net.head], device="cpu")
    with pytest.raises(AttributeError, match="blocks.0.norm.weight is sharded by FSDP"):
        net.blocks[0].norm.weight.sum()
    seen = []
    net.blocks[0].norm.register_forward_hook(
        lambda m, args, out: seen.append(m.weight.sum().item())
    )
    net(torch.randint(64, (1, 8)), torch.randint(64, (1, 8)))
    # LayerNorm's ones; freed after the block
    assert seen == [64.0] and fsdp.units[1].gathered is False


def test_dropping_the_trainer_frees_it():
    """Once train()'s results are dropped, gc.collect() frees the FSDP object and every shard
    buffer: no hook keeps them (a gradient hook held from C++ used to keep them for the life of the
    process)."""
    import gc
    import weakref

    _, _, fsdp = qf.fine_tune(qf.parse_args(BASE + ["--batch_size", "2", "--steps", "2"]))
    refs = [weakref.ref(fsdp)] + [
        weakref.ref(t) for u in fsdp.all_units for t in (u.shard_bytes, u.master) if t is not None
    ]
    del fsdp
    gc.collect()
    assert len(refs) > 5 and all(r() is None for r in refs)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_equals_single_process(world, tmp_path, single_run_tiny):
    """2 and 3 ranks (fp32) give the same losses and final adapters as one process on the same
    global batch; tiny's 128-wide tensors are not divisible by 3, so shards are padded."""
    results = run_sharded(world, BASE + ["--batch_size", str(6 // world)], tmp_path)
    for r in results:  # every rank gathers the same full adapters
        assert_same_run(r, single_run_tiny)
    if world == 3:
        sizes = [r["shard_sizes"]["model.layers.0.self_attn.q_proj.lora_A"] for r in results]
        assert sizes == [342, 342, 340]  # 8 x 128 = 1024 elements: the last shard is short
        # the short shard's padding, inside the flat master AdamW steps, is still exactly 0
        assert results[2]["padding_numel"] > 0 and results[2]["padding_sum"] == 0


def test_offload_accumulation_clipping_equal_single_process(tmp_path):
    """With --cpu_offload, gradient accumulation and (active) clipping, 2 ranks still equal one
    process. (On the CPU the offloaded state stays where it is; the copies to and from a GPU are
    test_cuda_training_equals_cpu's.)"""
    extra = ["--grad_accum", "2", "--grad_clip", "0.05", "--cpu_offload"]
    single = run_single(BASE + extra + ["--batch_size", "4"])
    results = run_sharded(2, BASE + extra + ["--batch_size", "2"], tmp_path)
    for r in results:
        assert_same_run(r, single)


def test_world_larger_than_some_tensors(tmp_path):
    """4 ranks on a model where some tensors have fewer elements than ranks (empty shards) equal
    one process, and each rank keeps at most total/4 of the weight bytes plus padding."""
    argv = BASE + ["--model", "micro"]
    single = run_single(argv + ["--batch_size", "4"])
    results = run_sharded(4, argv + ["--batch_size", "1"], tmp_path)
    for r in results:
        assert_same_run(r, single)
    assert results[3]["shard_sizes"]["model.layers.0.self_attn.k_proj.weight.scale_mean"] == 0
    assert results[3]["shard_sizes"]["model.layers.0.self_attn.k_proj.weight.scale_factor"] == 0
    # Resident weight bytes: total / world, plus per tensor at most one element (4 B) and a
    # frozen piece's padding to 16 B (15 B).
    model = make_model("micro")
    n_tensors = sum(4 if isinstance(p, qf.NF4Tensor) else 1 for p in model.parameters())
    total = single["local_bytes"]
    for r in results:
        assert r["local_bytes"] <= total / 4 + n_tensors * 19
        assert r["local_bytes"] >= total / 4 * 0.9


@pytest.mark.parametrize("compile", ["--no-compile", "--compile"])
def test_offloaded_activations_change_nothing(compile, monkeypatch):
    """--offload_activations moves every checkpointed block input (and nothing else) through a
    separate host buffer and back -- 4 blocks x 3 steps of (2, 32, 128) fp32, each block's but the
    last's copied back when the block after it starts its backward, ahead of its own -- and trains
    bitwise like the run that keeps them on the device, with eager blocks and with compiled ones
    (whose graph, not autograd's ops, decides what is saved)."""
    packed, real = [], qf.OffloadedInputs._pack

    def counting(self, t):
        out = real(self, t)
        if out is not t:
            packed.append(tuple(t.shape))
            assert out.host is not t and torch.equal(out.host, t)  # a copy, not the tensor itself
        return out

    real_unpack, ahead = qf.OffloadedInputs._unpack, []

    # was this block input's copy back issued before its backward asked for it?
    def unpacking(self, entry):
        if not isinstance(entry, torch.Tensor):
            ahead.append(entry.back is not None)
        return real_unpack(self, entry)

    monkeypatch.setattr(qf.OffloadedInputs, "_pack", counting)
    monkeypatch.setattr(qf.OffloadedInputs, "_unpack", unpacking)
    argv = [a for a in BASE if a != "--no-compile"] + ["--batch_size", "2", "--steps", "3", compile]
    plain = run_single(argv)
    assert packed == []
    offloaded = run_single(argv + ["--offload_activations"])
    assert packed == [(2, 32, 128)] * 4 * 3
    # each block's but the last's came back ahead of its backward
    assert ahead == [False, True, True, True] * 3
    assert plain["losses"] == offloaded["losses"]
    for k, v in plain["adapters"].items():
        assert torch.equal(offloaded["adapters"][k], v), k


def test_an_offloaded_inputs_copy_back_is_recorded_on_its_stream(monkeypatch):
    """The copy back of a parked block input, made in the compute stream's memory and written on
    the side stream, is recorded on that stream (record_stream), so that an error path freeing it
    early cannot let the allocator hand out its memory while the copy still writes it. A CPU has
    no streams: a stand-in stream, with its context and event stubbed, and record_stream counted."""
    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: recorded.append((t, s)))
    monkeypatch.setattr(qf, "_side", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", lambda: types.SimpleNamespace(record=lambda: None))
    stream = object()
    parked = qf._Parked(torch.device("cpu"), torch.randn(4, 8), None)
    qf.OffloadedInputs(stream)._fetch(parked)
    assert torch.equal(parked.back, parked.host)
    assert [(t is parked.back, s is stream) for t, s in recorded] == [(True, True)]


# ---- 6. AdamW ------------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("chunk_bytes", [None, 50])
def test_adamw_equals_torch(weight_decay, chunk_bytes, monkeypatch):
    """Our foreach AdamW equals torch.optim.AdamW over 50 steps, with and without weight decay, on
    fp32 and fp64 tensors mixed (each at its own precision), in one foreach chunk or in cache-sized
    chunks (here 50 bytes; one chunk holds an empty tensor), with two tensors that have no gradient
    at some steps (each keeps its own step count; chunks split where the counts differ)."""
    monkeypatch.setattr(qf, "ADAM_CHUNK_BYTES", {"cpu": chunk_bytes} if chunk_bytes else {})
    torch.manual_seed(0)
    params = [
        torch.randn(s, dtype=dtype, requires_grad=True)
        for s, dtype in [
            ((7, 3), torch.float32),
            ((64,), torch.float64),
            ((0,), torch.float32),
            ((5, 5, 2), torch.float32),
            ((9,), torch.float64),
        ]
    ]
    ref = [p.detach().clone().requires_grad_() for p in params]
    ours = qf.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    theirs = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    for step in range(50):
        for i, (p, r) in enumerate(zip(params, ref)):
            g = torch.randn_like(p) * (step + 1)
            skip = (i == 1 and step % 3 == 0) or (i == 3 and step < 2)
            p.grad, r.grad = (None, None) if skip else (g.clone(), g.clone())
        ours.step()
        theirs.step()
    for p, r in zip(params, ref):  # fp64: only the order of operations differs (~1e-16 a step)
        tol = 1e-12 if p.dtype == torch.float64 else 1e-7
        torch.testing.assert_close(p, r, rtol=10 * tol, atol=tol)


# ---- 7. Llama ------------------------------------------------------------------------------------


def test_initial_model_equals_base_model():
    """At initialization (B = 0) the model's logits equal the base model's, computed by a plain
    dense reference without any adapter."""
    model = make_model()
    tokens = torch.randint(256, (2, 24))
    with torch.no_grad():
        logits = model(tokens)
        for m in model.modules():  # the base model: no LoRA at all
            if isinstance(m, qf.LoRALinear):
                m.lora_A.zero_()
        base = reference_logits(model, tokens)
    torch.testing.assert_close(logits, base, rtol=1e-4, atol=1e-4)


def randomize_dense(model, seed=0):
    """Nonzero adapters, biases and norm weights (all ones or zeros at construction)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if isinstance(p, qf.NF4Tensor) or "embed" in name or "lm_head" in name:
                continue
            noise = torch.randn(p.shape, generator=g).to(p.dtype)
            p.add_(noise * 0.1)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_equals_reference_with_adapters(family, dora):
    """For each family, with non-zero adapters, biases and norms, the model equals the plain
    fp32 reference (GQA, RoPE, SwiGLU, RMSNorm with an eps of 0.5, large enough to show; the
    family's biases and q/k norms), logits and adapter gradients (q, k, v and gate, up share one
    x A^T matmul; the reference not), with LoRA and with DoRA (magnitudes moved too)."""
    torch.manual_seed(0)
    config = family_config(family, rms_norm_eps=0.5)
    model = qf.CausalLM(config, dtype=torch.float32, compile=False, dora=dora)
    randomize_dense(model)
    tokens = torch.randint(256, (2, 24))
    adapters = [p for p in model.parameters() if p.requires_grad]
    logits, ref = model(tokens), reference_logits(model, tokens)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    for g, g_ref in zip(
        torch.autograd.grad(logits.square().mean(), adapters),
        torch.autograd.grad(ref.square().mean(), adapters),
    ):
        torch.testing.assert_close(g, g_ref, rtol=1e-3, atol=1e-6)


def test_only_adapters_require_grad():
    """Only lora_A / lora_B train; every projection and lm_head is NF4; embeddings and norms are
    frozen in the compute dtype; state_dict keys are Hugging Face's plus the adapters."""
    model = make_model(dtype=torch.bfloat16)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert len(trainable) == 2 * 7 * model.config.num_hidden_layers
    sd = model.state_dict()
    for key in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.3.self_attn.v_proj.lora_A",
        "model.layers.3.mlp.up_proj.lora_B",
    ):
        assert key in sd, key
    # The lm_head stays dense by default (nf4_head=True: NF4).
    assert sd["lm_head.weight"].dtype == torch.bfloat16
    assert not isinstance(sd["lm_head.weight"], qf.NF4Tensor)
    assert isinstance(qf.CausalLM(model.config, nf4_head=True).lm_head.weight, qf.NF4Tensor)
    assert isinstance(sd["model.layers.0.self_attn.q_proj.weight"], qf.NF4Tensor)
    assert sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert sd["model.layers.0.self_attn.q_proj.lora_A"].dtype == torch.float32


def test_causal():
    """Changing future tokens does not change the logits of earlier positions."""
    model = make_model()
    tokens = torch.randint(256, (1, 16))
    other = tokens.clone()
    other[0, 10:] = (other[0, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(other)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("compile", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_equals_plain(dtype, compile, monkeypatch):
    """The chunked cross entropy (5 rows at a time; each chunk's kernel compiled or eager) and its
    gradient equal F.cross_entropy on the full logits."""
    monkeypatch.setattr(qf, "COMPILE", compile)
    torch.manual_seed(0)
    w = qf.to_nf4(torch.randn(256, 64, dtype=dtype) / 8)
    h = torch.randn(23, 64, dtype=dtype, requires_grad=True)
    t = torch.randint(256, (23,))
    loss = qf.chunked_cross_entropy(h, w, t, chunk=5)
    (2 * loss).backward()
    h_ref = h.detach().clone().requires_grad_()
    ref = F.cross_entropy((h_ref @ w.dequantize().T).float(), t)
    (2 * ref).backward()
    if dtype == torch.float32:
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-5)
    # bf16 logits: the loss within bf16's rounding, the gradient (|g| ~ 1e-2) to a tenth of its size
    else:
        torch.testing.assert_close(loss, ref, rtol=1e-3, atol=0)
        torch.testing.assert_close(h.grad, h_ref.grad, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("compile", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_loss_ignores_targets(reduction, compile, monkeypatch):
    """With some targets IGNORE_INDEX (-100), the chunked cross entropy and its gradient equal
    F.cross_entropy(ignore_index=-100) for reduction mean and sum; ignored rows get no gradient, and
    when every target is ignored the loss is 0 and the gradient zero (not 0/0); compiled and eager.
    """
    monkeypatch.setattr(qf, "COMPILE", compile)
    torch.manual_seed(0)
    w = qf.to_nf4(torch.randn(256, 64) / 8)
    t = torch.randint(256, (23,))
    # both ends, either side of a border of chunks of 5
    t[torch.tensor([0, 4, 5, 6, 17, 22])] = -100
    for targets in (t, torch.full((23,), -100)):
        h = torch.randn(23, 64, requires_grad=True)
        loss = qf.chunked_cross_entropy(h, w, targets, chunk=5, reduction=reduction)
        (2 * loss).backward()
        h_ref = h.detach().clone().requires_grad_()
        ref = F.cross_entropy(
            h_ref @ w.dequantize().T, targets, ignore_index=-100, reduction=reduction
        )
        if (targets == -100).all():
            assert loss.item() == 0 and torch.equal(h.grad, torch.zeros_like(h))
            continue
        (2 * ref).backward()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-6)
        assert torch.equal(h.grad[targets == -100], torch.zeros(6, 64))


def test_loss_equals_logits_cross_entropy():
    """forward(tokens, targets) equals cross entropy of forward(tokens), with checkpointing on."""
    model = make_model()
    x, y = torch.randint(256, (2, 12)), torch.randint(256, (2, 12))
    loss = model(x, y)
    with torch.no_grad():
        ref = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("bad", [-1, 50])
def test_loss_refuses_targets_out_of_range(bad, compile, monkeypatch):
    """A target outside [0, vocab) other than IGNORE_INDEX (-100) is an error, as in
    F.cross_entropy, not silently class 0; checked before the compiled kernel, whose own bounds
    check can abort the process."""
    monkeypatch.setattr(qf, "COMPILE", compile)
    h, W, y = torch.randn(6, 32), torch.randn(50, 32), torch.tensor([1, 2, bad, 4, -100, 6])
    with pytest.raises(IndexError):
        F.cross_entropy(h @ W.T, y)
    with pytest.raises(
        RuntimeError, match=r"a target is outside \[0, vocab\) and not IGNORE_INDEX"
    ):
        qf.chunked_cross_entropy(h, W, y)


def test_compiled_block_is_one_graph_holding_no_dense_weight():
    """What --compile compiles, a block's forward with its checkpoint, is one graph for dynamo (a
    graph break would run the rest eagerly without a word) whose body is the checkpoint, and the
    forward and backward graphs made of it (the recompute inside backward's) hold no tensor shaped
    like a dense base weight, not even for a moment: each NF4 weight is dequantized inside the
    matmul op that uses it."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    model = make_model(dtype=torch.bfloat16)
    layer = model.model.layers[0]
    dynamo_graphs, graphs = [], []

    def keep(gm, example_inputs):  # record a graph and run it as it is
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    aot = aot_autograd(
        fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition
    )
    backend = lambda gm, example_inputs: (dynamo_graphs.append(gm), aot(gm, example_inputs))[1]  # noqa: E731
    x = torch.randn(2, 16, 128, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = qf.rope_cos_sin(model.config, torch.arange(16), torch.bfloat16)
    torch.compile(layer.forward, backend=backend, fullgraph=True)(
        x, cos, sin, True
    ).float().sum().backward()
    calls = [n.target for n in dynamo_graphs[0].graph.nodes if n.op == "call_function"]
    assert len(dynamo_graphs) == 1 and calls[0] is torch.ops.higher_order.tag_activation_checkpoint
    shapes = {tuple(m.weight.shape) for m in layer.modules() if isinstance(m, qf.LoRALinear)}
    shapes |= {s[::-1] for s in shapes} | {(math.prod(s),) for s in shapes}  # transposed, flat
    # as text: a graph's shapes may hold (unhashable) SymInts
    shapes = {str(list(s)) for s in shapes}
    assert len(graphs) == 2  # forward, backward
    for gm in graphs:
        values = [n.meta.get("val") for n in gm.graph.nodes]
        dense = [
            v.shape
            for v in values
            if isinstance(v, torch.Tensor)
            and v.dtype.is_floating_point
            and str(list(v.shape)) in shapes
        ]
        assert dense == [] and len(values) > 100


def test_tiny_model_overfits_a_batch():
    """QLoRA on the tiny model drives the loss on one fixed batch far down in 30 steps (5.5 ->
    < 1.5), with eager kernels (the compiled ones give the same bits: tested on their own)."""
    model = make_model(dtype=torch.float32, lora_rank=16, compile=False)
    opt = qf.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0)
    x = torch.randint(256, (2, 32))
    y = torch.roll(x, -1, 1)
    first = None
    for _ in range(30):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        first = first or loss.item()
    assert first > 5.0 and loss.item() < 1.5


def test_rmsnorm_and_rope_tables_as_hugging_face():
    """A bf16 RMSNorm with a random weight equals Hugging Face's weight * (normalized in fp32, cast
    to bf16), bit for bit; RoPE's cos and sin tables are those of positions 0, 1, ... (the
    frequencies twice)."""
    norm = qf.RMSNorm(256, 1e-5, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256))
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(norm(x), norm.weight * h.to(torch.bfloat16))
    c = qf.CONFIGS["tiny"]
    cos, sin = qf.rope_cos_sin(c, torch.arange(5), torch.float32)
    inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
    angles = torch.arange(5, dtype=torch.float64)[:, None] * inv
    torch.testing.assert_close(cos, torch.cat([angles, angles], -1).cos().float())
    torch.testing.assert_close(sin, torch.cat([angles, angles], -1).sin().float())


def test_each_norm_in_its_place():
    """With every norm weight random (not 1), the model equals the plain fp32 reference: each
    block's two norms and the final one each scale what they should."""
    torch.manual_seed(0)
    model = qf.Llama(qf.CONFIGS["tiny"], dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
        tokens = torch.randint(256, (2, 16))
        torch.testing.assert_close(
            model(tokens), reference_logits(model, tokens), rtol=1e-4, atol=1e-4
        )


# ---- 8. training: the batch, the step, the loop --------------------------------------------------


def test_learning_rate_warmup_then_cosine():
    """The learning rate rises linearly over --warmup_steps to --lr, then falls along a cosine to
    10% of --lr at --steps: 0.55 of --lr halfway."""
    args = qf.parse_args(["--lr", "2.0", "--warmup_steps", "4", "--steps", "104"])
    lrs = [qf.learning_rate(step, args) for step in range(105)]
    assert lrs[:5] == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0])
    assert lrs[54] == pytest.approx(1.1) and lrs[104] == pytest.approx(0.2)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))


def test_compiled_blocks_equal_eager():
    """--compile (NF4 kernels and every block's forward compiled, sharding hooks eager) trains
    like the eager run: same losses and adapters up to fp32 rounding."""
    argv = [a for a in BASE if a != "--no-compile"] + ["--batch_size", "2", "--steps", "3"]
    eager = run_single(argv + ["--no-compile"])
    compiled = run_single(argv + ["--compile"])
    torch.testing.assert_close(
        torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-5
    )
    for k, v in eager["adapters"].items():
        torch.testing.assert_close(compiled["adapters"][k], v, rtol=1e-4, atol=1e-5, msg=k)


def random_ids(n=4000, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n)


def test_ranks_split_the_global_batch(tmp_path):
    """A step's global batch depends only on (seed, step) and batch_size x grad_accum x world, laid
    out (micro, rank, row): 1 rank's batch of 8 is 2 ranks' batches of 4 side by side, and 2 ranks'
    2 micro-batches of 2 each -- random (dummy) tokens and a file's."""
    np.save(tmp_path / "ids.npy", random_ids())
    for data in (None, qf.load_tokens(str(tmp_path / "ids.npy"), 256)):
        one = batch_of(data, 3, 0, qf.parse_args(BASE + ["--batch_size", "8"]), 1, 0, 256)
        two = [
            batch_of(data, 3, 0, qf.parse_args(BASE + ["--batch_size", "4"]), 2, r, 256)
            for r in range(2)
        ]
        four = [
            batch_of(
                data,
                3,
                m,
                qf.parse_args(BASE + ["--batch_size", "2", "--grad_accum", "2"]),
                2,
                r,
                256,
            )
            for m in range(2)
            for r in range(2)
        ]
        for i in range(2):  # inputs, targets
            assert torch.equal(torch.cat([two[0][i], two[1][i]]), one[i])
            assert torch.equal(torch.cat([b[i] for b in four]), one[i])


def test_all_ones_mask_trains_as_bare_tokens(tmp_path):
    """An .npz whose loss_mask is all ones trains bitwise like the same tokens as a bare .npy."""
    ids = random_ids()
    np.save(tmp_path / "bare.npy", ids.astype(np.uint16))
    np.savez(tmp_path / "ones.npz", tokens=ids.astype(np.uint32), loss_mask=np.ones(len(ids), bool))
    argv = BASE + ["--batch_size", "2", "--steps", "2", "--grad_accum", "2"]
    bare = run_single(argv + ["--data", str(tmp_path / "bare.npy")])
    ones = run_single(argv + ["--data", str(tmp_path / "ones.npz")])
    assert ones["losses"] == bare["losses"]
    for k, v in bare["adapters"].items():
        assert torch.equal(ones["adapters"][k], v), k


def test_masked_loss_is_the_global_mean_at_any_world_size(tmp_path):
    """With a loss mask the loss is the mean cross entropy over the counted targets of the WHOLE
    global batch (all ranks, all micro-batches): step 1's loss is F.cross_entropy over the counted
    targets of the model's logits for that batch, and 1 process and 3 ranks, with 2 micro-batches
    whose counts differ, train alike (the same losses and adapters)."""
    ids = random_ids()
    np.save(tmp_path / "bare.npy", ids)
    # a target counts where its id is a multiple of 3: the mask of any batch follows from its
    # targets
    np.savez(tmp_path / "masked.npz", tokens=ids, loss_mask=(ids % 3 == 0).astype(np.uint8))
    argv = BASE + ["--data", str(tmp_path / "masked.npz"), "--grad_accum", "2", "--steps", "2"]
    single = run_single(argv + ["--batch_size", "3"])
    args = qf.parse_args(BASE + ["--batch_size", "3", "--grad_accum", "2"])
    model, _ = build(args, qf.CONFIGS["tiny"])  # the untrained model
    bare = qf.TokenData(np.load(tmp_path / "bare.npy"), None)
    x, y = map(
        torch.cat, zip(*[batch_of(bare, 0, micro, args, 1, 0, 256)[:2] for micro in range(2)])
    )
    # (6, 32): rows 0-2 the first micro-batch, 3-5 the second; one row per rank
    counted = y % 3 == 0
    assert len(set(counted.sum(1).tolist())) > 1  # ranks and micro-batches count differently
    with torch.no_grad():
        logits = model(x)
    ref = F.cross_entropy(logits[counted], y[counted])
    torch.testing.assert_close(torch.tensor(single["losses"][0]), ref, rtol=1e-5, atol=1e-5)
    for r in run_sharded(3, argv + ["--batch_size", "1"], tmp_path):
        assert_same_run(r, single)


@pytest.mark.parametrize("compile", ["--no-compile", "--compile"])
def test_accumulated_step_equals_torch_adamw_on_the_whole_batch(compile, tmp_path):
    """One training step over 2 micro-batches that count different numbers of targets moves the
    adapters as torch.optim.AdamW does with the gradient of F.cross_entropy over the counted
    targets of both, taken in one plain autograd pass through an unsharded copy of the model;
    eager and compiled (at the shapes of the compiled tests above: their graphs)."""
    ids = random_ids()
    np.savez(tmp_path / "masked.npz", tokens=ids, loss_mask=(ids % 3 == 0).astype(np.uint8))
    argv = [a for a in BASE if a != "--no-compile"] + [
        compile,
        "--data",
        str(tmp_path / "masked.npz"),
        "--grad_accum",
        "2",
        "--steps",
        "1",
        "--batch_size",
        "2",
        "--grad_clip",
        "0",
    ]
    args = qf.parse_args(argv)
    trained = run_single(argv)["adapters"]
    _, fsdp = build(qf.parse_args(argv + ["--no-compile"]), qf.CONFIGS["tiny"])
    model = make_model()  # the run's starting weights, in full, unsharded:
    # each valid until the next unit is gathered
    base = {name: t.clone() for name, t in fsdp.full_base()}
    model.load_state_dict({**base, **fsdp.full_adapters()})
    data = qf.load_tokens(str(tmp_path / "masked.npz"), 256)
    x, y = map(
        torch.cat, zip(*[batch_of(data, 0, micro, args, 1, 0, 256)[:2] for micro in range(2)])
    )
    counted = y != qf.IGNORE_INDEX  # (4, 32): rows 0-1 the first micro-batch, 2-3 the second
    assert counted[:2].sum() != counted[2:].sum()
    F.cross_entropy(model(x)[counted], y[counted]).backward()
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    torch.optim.AdamW(
        adapters.values(), lr=qf.learning_rate(0, args), eps=args.adam_eps, weight_decay=0.0
    ).step()
    for name, p in adapters.items():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_batch_counting_nothing_gives_zero_loss_and_no_update(tmp_path):
    """Steps whose global batch counts no target log loss 0 and leave the adapters exactly at
    their initial values: zero gradients, no 0/0."""
    mask = np.zeros(4000, np.uint8)
    mask[1] = 1  # the only counted target: in a window only if it starts at token 0
    path = str(tmp_path / "rare.npz")
    np.savez(path, tokens=random_ids(), loss_mask=mask)
    args = qf.parse_args(BASE + ["--data", path, "--batch_size", "2", "--steps", "2"])
    data = qf.load_tokens(path, 256)
    assert all((batch_of(data, step, 0, args, 1, 0, 256)[1] == -100).all() for step in range(2))
    _, losses, fsdp = qf.fine_tune(args)
    assert losses == [0.0, 0.0]
    initial = dict(qf.initial_weights(fsdp.adapter_shapes(), args.seed))
    for k, v in fsdp.full_adapters().items():
        assert torch.equal(v, initial[k].float()), k


class GradRecorder:
    """In place of the optimizer: keeps the gradients train_step hands it."""

    def __init__(self, params):
        self.params, self.grads = params, None

    def step(self):
        self.grads = [p.grad.clone() for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def test_step_gradient_is_the_summed_loss_gradient_over_the_count_in_fp32():
    """In bf16, train_step hands the optimizer exactly the gradient of the summed loss divided in
    fp32 by the number of counted targets (63: its inverse is no bf16 number), the reference taken
    by a plain backward of the summed loss through the same sharded model."""
    args = qf.parse_args(["bf16" if a == "fp32" else a for a in BASE] + ["--batch_size", "2"])
    model, fsdp = build(args, qf.CONFIGS[args.model])
    x, y, _ = qf.get_batch(None, 0, 0, args, 1, 0, qf.CONFIGS[args.model].vocab_size)
    y = y.clone()  # a view of the tokens x holds too
    y[0, 0] = qf.IGNORE_INDEX
    model(x, y, reduction="sum").backward()
    reference = [p.grad / 63 for p in fsdp.parameters()]
    recorder = GradRecorder(fsdp.parameters())
    recorder.zero_grad()
    qf.train_step(model, fsdp, recorder, [(x, y)], 0.0, torch.device("cpu"))
    assert len(reference) >= 2 and any(g.abs().sum() > 0 for g in reference)
    for got, want in zip(recorder.grads, reference):
        assert torch.equal(got, want)


def test_skipped_step_updates_nothing_and_leaves_no_gradient():
    """A step whose loss is not finite leaves the adapters as they were and no gradient behind,
    which the next step would otherwise add its own to."""
    args = qf.parse_args(BASE + ["--batch_size", "2"])
    config = qf.CONFIGS[args.model]
    model, fsdp = build(args, config)
    before = fsdp.full_adapters()
    fsdp.load_full("model.norm.weight", torch.full((config.hidden_size,), float("nan")))
    batch = qf.get_batch(None, 0, 0, args, 1, 0, config.vocab_size)
    loss = qf.train_step(
        model, fsdp, qf.AdamW(fsdp.parameters()), [batch], 1.0, torch.device("cpu")
    )
    assert math.isnan(loss)
    assert all(p.grad is None for p in fsdp.parameters())
    for name, t in fsdp.full_adapters().items():
        assert torch.equal(t, before[name]), name


# ---- 9. faster NF4: the bf16 kernel, copy_ -------------------------------------------------------


def test_vectorized_dequantize_equals_table_lookup():
    """The select-tree + packed-pairs formulation (what torch.compile gets for bf16) gives the
    table lookup's bf16 values bit for bit: every code, zero blocks, tiny and huge scales, and
    the manual fp32 -> bf16 rounding on ties, subnormals and large values."""
    codes = torch.arange(16)
    assert torch.equal(qf._nf4_lookup(codes), qf.NF4[codes])
    x = torch.cat(
        [
            torch.randn(10000) * 10.0 ** torch.randint(-40, 38, (10000,)).float(),
            torch.tensor([0.0, -0.0, 1e-45, -3e-39, 3.4e38, 1.00390625, 1.01171875, -1.01171875]),
        ]
    )
    assert torch.equal(qf._bf16_bits(x).to(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    w = torch.randn(64, 1024) * torch.logspace(-30, 30, 64)[:, None]
    w[3] = 0.0  # an all-zero row: 16 blocks whose absmax is 0
    w[5, :64] = torch.linspace(-1, 1, 64)  # a block that hits every code
    parts = qf.quantize_nf4(w, compile=False)
    ref = qf.dequantize_nf4(*parts, dtype=torch.bfloat16, compile=False)
    assert torch.equal(qf._dequantize_bf16_pairs(*parts, 64, 256).view(torch.bfloat16), ref)
    assert torch.equal(qf.dequantize_nf4(*parts, dtype=torch.bfloat16, compile=True), ref)
    # traced into a bigger compiled graph it is one custom op, with the same values
    outer = torch.compile(
        lambda *p: qf.dequantize_nf4(*p, dtype=torch.bfloat16) * 1, fullgraph=True
    )
    assert torch.equal(outer(*parts), ref)


@pytest.mark.parametrize(
    "src_blocks,dst_blocks",
    [((64, 5), (64, 4)), ((32, 256), (64, 256)), ((64, 256), (64, 256))],
    ids=["scale groups 5 into 4", "blocks 32 into 64", "same layout"],
)
def test_copy_between_layouts_requantizes(src_blocks, dst_blocks):
    """NF4 copy_ checks the layout first: from the same layout the codes are copied exactly;
    from another (other scale groups with the same inner shapes, or other block sizes) the
    source is re-quantized into the destination's layout, as torchao does; nothing is written
    when the shapes differ."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g)
    src = qf.to_nf4(w, *src_blocks, compile=False)
    dst = qf.to_nf4(torch.randn(40, 64, generator=g), *dst_blocks, compile=False)
    dst.copy_(src)
    want = src
    if src_blocks != dst_blocks:
        want = qf.to_nf4(src.dequantize(torch.float32), *dst_blocks, compile=False)
    for name in qf.NF4Tensor.INNER:
        assert torch.equal(getattr(dst, name), getattr(want, name)), name
    assert (dst.block_size, dst.scaler_block_size) == dst_blocks
    before = [t.clone() for t in dst.inner()]
    with pytest.raises(ValueError, match="copy_ into"):
        dst.copy_(qf.to_nf4(torch.randn(64, 40), 32, compile=False))
    assert all(torch.equal(a, b) for a, b in zip(dst.inner(), before))


def test_dense_copy_from_nf4_dequantizes():
    """dense.copy_(nf4) writes the dequantized weight, in the dense tensor's dtype."""
    nf4 = qf.to_nf4(torch.randn(32, 64), compile=False)
    dense = torch.empty(32, 64, dtype=torch.bfloat16)
    dense.copy_(nf4)
    assert torch.equal(dense, nf4.dequantize(torch.bfloat16))


# ---- 10. any model: FSDP2's own test cases, drawn cases, AdamW as torch's drop-in ----------------


# The models of torch.testing._internal.common_fsdp (MLP, MLPStack, DoubleLinear) and the
# chunked head of test_fully_shard_training.py, written again here (that module needs
# expecttest). Each case runs sharded at worlds 1-3 on gloo, each rank on its rows of one
# global batch of 6, and unsharded on the whole batch; gradients and weights must agree.


class MLP(torch.nn.Module):
    def __init__(self, dim, multiplier=4):
        super().__init__()
        self.in_proj = torch.nn.Linear(dim, multiplier * dim)
        self.out_proj = torch.nn.Linear(multiplier * dim, dim)

    def forward(self, x):
        return F.relu(self.out_proj(F.relu(self.in_proj(x))))


def mlp_stack(dim=8):
    """MLPStack: multipliers 3, 4, 3 (the uneven shards FSDP2's suite exercises)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(MLP(dim, 3), MLP(dim), MLP(dim, 3))


class DoubleLinear(torch.nn.Module):
    """Two outputs from one module: the second one may go unused."""

    def __init__(self, dim):
        super().__init__()
        self.lin1 = torch.nn.Linear(dim, dim)
        self.lin2 = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return F.relu(self.lin1(x)), F.relu(self.lin2(x))


class UnusedOutput(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(dim, dim)
        self.pair = DoubleLinear(dim)

    def forward(self, x):
        used, _ = self.pair(self.trunk(x))
        return used


class ChunkedHead(torch.nn.Module):
    """Embeddings, a body, a norm and a head, as FSDP2's ChunkedHeadModel; the head may be skipped
    and called alone later."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.body = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, skip_head=False, checkpointing=False):
        h = self.embed(tokens)
        if checkpointing:  # around the module call: its hooks run again in the recompute
            h = torch.utils.checkpoint.checkpoint(self.body, h, use_reentrant=False)
        else:
            h = self.body(h)
        h = self.norm(h)
        return h if skip_head else self.head(h)


def rows_of(rank, world, n=6):
    return slice(rank * n // world, (rank + 1) * n // world)


def full_of(model, fsdp, names, of):
    """{name: full tensor} of of(parameter) for the named trainable parameters."""
    if fsdp is None:
        params = dict(model.named_parameters())
        return {n: of(params[n]).detach().clone() for n in names}
    return {n: t for n, t in fsdp.full_adapters(of=of).items() if n in names}


def grad_or_zeros(p):
    return torch.zeros_like(p) if p.grad is None else p.grad


def partial_unit_case(rank, world, shard, checkpointing):
    """[norm, head] as one unit: (1) two forwards that skip the head, one backward; (2) a forward
    that skips the head, then the head alone on two chunks of the detached hidden state, a
    backward each, then the backward through the rest. -> (gradients of 1, gradients of 2)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(32, (6, 8), generator=g)[rows_of(rank, world)]
    targets = torch.randint(32, (6, 8), generator=g)[rows_of(rank, world)]
    out = []
    for case in ("skipped twice", "then alone"):
        model = ChunkedHead()
        names = [n for n, _ in model.named_parameters()]
        units = [model.embed, model.body, [model.norm, model.head]]
        fsdp = qf.FSDP(model, units, device="cpu") if shard else None
        if case == "skipped twice":
            h1 = model(tokens[:, :4], skip_head=True, checkpointing=checkpointing)
            h2 = model(tokens[:, 4:], skip_head=True, checkpointing=checkpointing)
            (h1.square().mean() + h2.square().mean()).backward()
        else:
            h = model(tokens, skip_head=True, checkpointing=checkpointing)
            detached = h.detach().requires_grad_()
            for chunk, y in zip(detached.chunk(2, dim=1), targets.chunk(2, dim=1)):
                logits = model.head(chunk).flatten(0, 1)
                F.cross_entropy(logits, y.flatten(), reduction="sum").div(
                    targets.numel()
                ).backward()
            h.backward(detached.grad)
        out.append(full_of(model, fsdp, names, grad_or_zeros))
    return out


def unused_output_case(rank, world, shard):
    """DoubleLinear's second output unused, 4 AdamW steps with weight decay -> (whether each
    parameter's .grad was None after the first backward, the weights after)."""
    model = UnusedOutput()
    names = [n for n, _ in model.named_parameters()]
    fsdp = qf.FSDP(model, [model.trunk, model.pair], device="cpu") if shard else None
    params = [p for p in model.parameters()]
    optimizer = (qf.AdamW if shard else torch.optim.AdamW)(params, lr=1e-2, weight_decay=0.1)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))[rows_of(rank, world)]
    no_grad = None
    for _ in range(4):
        model(x).square().mean().backward()
        if no_grad is None:
            no_grad = {n: p.grad is None for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return no_grad, full_of(model, fsdp, names, lambda p: p)


def stack_steps(rank, world, shard, setup):
    """3 AdamW steps of MLPStack, each MLP a unit, after setup(model, fsdp) -> its optimizer."""
    model = mlp_stack()
    names = [n for n, _ in model.named_parameters()]
    fsdp = qf.FSDP(model, list(model), device="cpu") if shard else None
    optimizer = setup(model, shard)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(6, 8, generator=g)[rows_of(rank, world)]
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_of(model, fsdp, names, lambda p: p)


def frozen_after_wrapping(model, shard):
    """0.in_proj.weight frozen (after FSDP, on the sharded model), the rest trained."""
    dict(model.named_parameters())["0.in_proj.weight"].requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    return (qf.AdamW if shard else torch.optim.AdamW)(params, lr=1e-2, weight_decay=0.1)


def parameter_groups(model, shard):
    """LoRA+-style groups: the out_proj weights at 16x the learning rate, biases without decay."""
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if "out_proj.weight" in n], "lr": 1.6e-1},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
        {"params": [p for n, p in named if "in_proj.weight" in n]},
    ]
    return (qf.AdamW if shard else torch.optim.AdamW)(groups, lr=1e-2, weight_decay=0.1)


def clip_case(rank, world, shard):
    """One backward of MLPStack, clipped to 0.1 in the L1, L2 and max norms: [(norm, grads)]."""
    out = []
    for norm_type in (1.0, 2.0, math.inf):
        model = mlp_stack()
        names = [n for n, _ in model.named_parameters()]
        fsdp = qf.FSDP(model, list(model), device="cpu") if shard else None
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))[rows_of(rank, world)]
        model(x).square().mean().backward()
        if shard:
            norm = fsdp.clip_grad_norm_(0.1, norm_type=norm_type)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type=norm_type)
        out.append((norm.item(), full_of(model, fsdp, names, grad_or_zeros)))
    return out


def fsdp2_cases(rank, world, shard=True):
    cases = {
        "partial": partial_unit_case(rank, world, shard, checkpointing=False),
        "partial, checkpointed": partial_unit_case(rank, world, shard, checkpointing=True),
        "unused": unused_output_case(rank, world, shard),
        "frozen": stack_steps(rank, world, shard, frozen_after_wrapping),
        "groups": stack_steps(rank, world, shard, parameter_groups),
        "clip": clip_case(rank, world, shard),
    }
    if shard:  # these compare with the unsharded model themselves
        cases["tied head"] = tied_head_cases(rank, world)
        if world in DRAWN_SEEDS:
            cases["drawn"] = drawn_cases(rank, world, DRAWN_SEEDS[world])
    return cases


# The drawn cases' seeds at each world size (below).
DRAWN_SEEDS = {1: range(200), 2: range(1000, 1200)}


def _fsdp2_worker(rank, world, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.save(fsdp2_cases(rank, world), f"{out_path}.{rank}")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory):
    """{world: [each rank's results]} at worlds 1, 2, 3, and the unsharded reference."""
    runs = {"unsharded": fsdp2_cases(0, 1, shard=False), 1: [fsdp2_cases(0, 1)]}
    for world in (2, 3):
        out = str(tmp_path_factory.mktemp("fsdp2") / "cases")
        spawn(_fsdp2_worker, (world, free_port(), out), world)
        runs[world] = [torch.load(f"{out}.{r}") for r in range(world)]
    return runs


def assert_same_tensors(got, want, rtol=1e-5, atol=1e-6):
    assert got.keys() == want.keys()
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("case", ["partial", "partial, checkpointed"])
def test_a_unit_with_a_module_skipped_or_used_alone(world, case, fsdp2_runs):
    """A unit of two modules, [norm, head]: two forwards that skip the head and one backward, and
    a forward that skips it followed by the head alone on chunks of the detached hidden state
    (a backward each), give the unsharded model's gradients, with the body checkpointed around
    its call or not; nothing crashes (the first used to end in SIGSEGV, the second in
    'head.weight is sharded' after losing chunk 1's gradient)."""
    want = fsdp2_runs["unsharded"][case]
    for rank_result in fsdp2_runs[world]:
        for got, expected in zip(rank_result[case], want):
            assert_same_tensors(got, expected)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_parameter_without_gradient_keeps_none_and_does_not_move(world, fsdp2_runs):
    """A trainable parameter that no gradient reaches (DoubleLinear's unused second output) has
    .grad None, as with FSDP2, and AdamW (weight decay 0.1, 4 steps) leaves it exactly as it was;
    the rest equals torch.optim.AdamW on the unsharded model."""
    want_none, want = fsdp2_runs["unsharded"]["unused"]
    assert [n for n, none in want_none.items() if none] == [
        "pair.lin2.weight",
        "pair.lin2.bias",
    ]
    for no_grad, weights in (r["unused"] for r in fsdp2_runs[world]):
        assert no_grad == want_none
        assert_same_tensors(weights, want)
        torch.manual_seed(0)
        initial = UnusedOutput()
        for name in ("pair.lin2.weight", "pair.lin2.bias"):
            assert torch.equal(weights[name], dict(initial.named_parameters())[name].detach())


@pytest.mark.parametrize("world", [1, 2, 3])
def test_requires_grad_false_after_wrapping_freezes(world, fsdp2_runs):
    """model.named_parameters() after FSDP gives each trainable parameter's piece under its own
    name; requires_grad_(False) on one freezes it: it stays as it was, and 3 steps equal the
    unsharded model with the same parameter frozen."""
    want = fsdp2_runs["unsharded"]["frozen"]
    initial = dict(mlp_stack().named_parameters())["0.in_proj.weight"].detach()
    for rank_result in fsdp2_runs[world]:
        assert_same_tensors(rank_result["frozen"], want)
        assert torch.equal(rank_result["frozen"]["0.in_proj.weight"], initial)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_optimizer_parameter_groups(world, fsdp2_runs):
    """Optimizer groups over the sharded parameters (the out_proj weights at 16x the learning
    rate, LoRA+-style, and the biases without weight decay) step as torch.optim.AdamW's same
    groups step the unsharded model."""
    want = fsdp2_runs["unsharded"]["groups"]
    for rank_result in fsdp2_runs[world]:
        assert_same_tensors(rank_result["groups"], want)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_clip_grad_norm_of_every_norm_type(world, fsdp2_runs):
    """clip_grad_norm_(max_norm, norm_type) for the L1, L2 and max norms returns the global norm
    over all ranks' shards and clips as torch.nn.utils.clip_grad_norm_ does unsharded."""
    want = fsdp2_runs["unsharded"]["clip"]
    for rank_result in fsdp2_runs[world]:
        for (norm, grads), (want_norm, want_grads) in zip(rank_result["clip"], want):
            assert norm == pytest.approx(want_norm, rel=1e-5)
            assert_same_tensors(grads, want_grads)


class TiedHead(torch.nn.Module):
    """FSDP2's test_partial_group_forward_then_standalone model: embed, body, final norm and a
    head that may share the embedding's weight."""

    def __init__(self, tied, dim=32, vocab=128):
        super().__init__()
        torch.manual_seed(42)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.body = torch.nn.Linear(dim, dim, bias=False)
        self.norm = torch.nn.RMSNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.checkpointing = False

    def forward(self, tokens):
        h = self.embed(tokens)
        if self.checkpointing:
            h = torch.utils.checkpoint.checkpoint(self.body, h, use_reentrant=False)
        else:
            h = self.body(h)
        return self.norm(h)


# The groupings of TiedHead into units, by name; the parameters of modules in none: the root's.
TIED_HEAD_UNITS = {
    "embed+norm+head, body": [["embed", "norm", "head"], ["body"]],
    "embed, body, norm+head": [["embed"], ["body"], ["norm", "head"]],
    "body, the rest the root": [["body"]],
}


def tied_head_units(model, grouping):
    modules = dict(model.named_modules())
    return [[modules[name] for name in group] for group in TIED_HEAD_UNITS[grouping]]


def chunked_head_backward(model, tokens, scale=1.0):
    """The forward to the norm, the head on 4 detached chunks of it (a backward each), then the
    backward through the rest: the pattern of FSDP2's test."""
    h = model(tokens)
    grads = []
    for chunk in torch.chunk(h.detach(), 4, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        (model.head(chunk).sum() * scale).backward()
        grads.append(chunk.grad)
    h.backward(torch.cat(grads, dim=1))


def tied_head_case(rank, world, shard, tied, grouping, checkpointing):
    """-> {name: gradient, NaN if None} of the chunked-head pattern on this rank's rows; unsharded
    (shard False): each rank's rows in turn at weight 1 / world, as FSDP averages over ranks."""
    model = TiedHead(tied)
    model.checkpointing = checkpointing
    tokens = torch.randint(128, (2 * world, 16), generator=torch.Generator().manual_seed(0))
    if not shard:
        for r in range(world):
            chunked_head_backward(model, tokens[2 * r : 2 * r + 2], 1 / world)
        return {n: grad_or_nan(p) for n, p in model.named_parameters(remove_duplicate=False)}
    fsdp = qf.FSDP(model, tied_head_units(model, grouping), device="cpu")
    chunked_head_backward(model, tokens[2 * rank : 2 * rank + 2])
    return fsdp.full_adapters(of=grad_or_nan)


def grad_or_nan(p):
    return torch.full_like(p, math.nan) if p.grad is None else p.grad.detach().clone()


# (tied, grouping, checkpointing): tied weights may not be split between units.
TIED_HEAD_CASES = [
    (tied, grouping, checkpointing)
    for tied in (True, False)
    for grouping in TIED_HEAD_UNITS
    for checkpointing in (False, True)
    if not (tied and grouping == "embed, body, norm+head")
]


def tied_head_cases(rank, world):
    return [tied_head_case(rank, world, True, *case) for case in TIED_HEAD_CASES]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_tied_head_in_a_unit_with_the_final_norm_loses_no_gradient(world, fsdp2_runs):
    """FSDP2's test_partial_group_forward_then_standalone: the head on 4 detached chunks of the
    normed output (a backward each), then the output's backward. Every gradient of the unsharded
    model (the final norm's too), equal to it, tied or untied, in each grouping of
    TIED_HEAD_UNITS, with the body checkpointed or not. (The norm's was lost: its unit reduced
    twice in one backward, and only the second reduction's record of which tensors had a
    gradient was kept.)"""
    for i, case in enumerate(TIED_HEAD_CASES):
        want = tied_head_case(0, world, False, *case)
        assert not want["norm.weight"].isnan().any()
        distinct = {id(p) for p in TiedHead(case[0]).parameters()}
        for rank_result in fsdp2_runs[world]:
            got = rank_result["tied head"][i]
            assert len(got) == len(distinct), case
            for name, g in got.items():
                # The losses are sums (up to 500 in a gradient): fp32 rounding, to their scale.
                atol = 1e-6 * want[name].abs().max().item()
                torch.testing.assert_close(
                    g, want[name], rtol=1e-5, atol=atol, equal_nan=True, msg=f"{case}: {name}"
                )


def test_a_tied_weight_split_between_units_is_refused():
    """Tied embedding and head in two units (embed, body, norm+head) is a clear error."""
    model = TiedHead(tied=True)
    with pytest.raises(ValueError, match="head.weight .also embed.weight. is in two units"):
        qf.FSDP(model, tied_head_units(model, "embed, body, norm+head"), device="cpu")


def test_a_unit_whose_embedding_call_has_no_node_is_gathered_once_for_its_backward(monkeypatch):
    """[embed, norm, head]: the embedding's input needs no gradient, so no node says when its
    backward is over. The unit stays gathered until the end of the output's backward: in that
    backward it is all-gathered once and reduce-scattered once, as the body is (2 and 2), not
    gathered and reduced a second time after the norm's node freed it too early (3 and 3)."""
    model = TiedHead(tied=True)
    fsdp = qf.FSDP(model, tied_head_units(model, "embed+norm+head, body"), device="cpu")
    tokens = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(0))
    h = model(tokens)
    grads = []
    for chunk in torch.chunk(h.detach(), 4, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        model.head(chunk).sum().backward()
        grads.append(chunk.grad)
    calls = {"all_gather": 0, "reduce_scatter": 0}
    real = qf._collective

    def counted(*a, reduce_scatter=False, **k):
        calls["reduce_scatter" if reduce_scatter else "all_gather"] += 1
        return real(*a, reduce_scatter=reduce_scatter, **k)

    monkeypatch.setattr(qf, "_collective", counted)
    h.backward(torch.cat(grads, dim=1))
    assert calls == {"all_gather": 2, "reduce_scatter": 2}
    assert not fsdp.units[0].gathered


def test_a_unit_listing_a_module_and_one_inside_it_is_refused():
    """A unit may lie inside another unit, but one unit listing both a module and a module inside
    it is a clear error (the inner call used to end the unit's pass mid-call: a crash)."""
    model = DrawnCase(0).model()
    block = TwoLayers(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), "chain")
    model.blocks[0] = block
    with pytest.raises(ValueError, match="lists blocks.0.first and blocks.0, which holds it"):
        qf.FSDP(model, [[block, block.first]], device="cpu")


@pytest.mark.parametrize("world", [1, 2])
def test_drawn_models_units_and_calls_equal_the_unsharded_model(world, fsdp2_runs):
    """200 cases drawn at each world size (DrawnCase, seeded): tied or untied weights, nested
    modules, blocks skipped, repeated or partly called, units of any modules in any order, six
    call patterns. Every gradient and weight over 2 AdamW steps equals torch.optim.AdamW's on the
    unsharded model, or FSDP refuses the units with its clear error, as predicted."""
    results = fsdp2_runs[world][0]["drawn"]
    wrong = {seed: r for seed, r in results.items() if r and not r.startswith("refused: ")}
    shown = [f"{DrawnCase(seed)}\n  -> {r}" for seed, r in list(wrong.items())[:3]]
    assert not wrong, f"{len(wrong)} of {len(results)} drawn cases:\n" + "\n".join(shown)
    outcomes = collections.Counter(results.values())
    assert len(results) == 200
    assert outcomes[""] >= 130, outcomes
    assert outcomes["refused: in two units"] > 0 and outcomes["refused: which holds it"] > 0


# Each case is drawn from its seed alone, so every rank draws the same one. A model: an
# embedding (maybe frozen, so that the blocks' input needs no gradient), 1-3 blocks (a layer, or
# two layers inside one module called in a chain, one skipped, one twice, summed or as a pair
# out), some skipped or called twice, some checkpointed around their call, a final norm and a
# head (maybe tied to the embedding; two Linear blocks may share a weight too). Its units: any
# of its modules, the nested ones included, alone or in lists, in a drawn order; the rest: the
# root's. Its call pattern: one of DRAWN_PATTERNS. FSDP must give torch.optim.AdamW's unsharded
# gradients and weights over 2 steps, or refuse the units with its clear error.

DRAWN_DIM = 8


DRAWN_VOCAB = 16


DRAWN_ROWS = 4  # per rank


DRAWN_PATTERNS = [
    "plain",
    "two passes, one backward",
    "chunked head",
    "two forwards, then two backwards",
    "grad_accum",
    "no_grad forward before the backward",
]


class Squared(torch.nn.Module):
    """y = x w^2: backward reads the weight itself again, not only the input."""

    def __init__(self, g):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(DRAWN_DIM, generator=g))

    def forward(self, x):
        return x * self.weight * self.weight


def drawn_layer(kind, g):
    if kind == "linear":
        return torch.nn.Linear(DRAWN_DIM, DRAWN_DIM, bias=bool(torch.randint(2, (), generator=g)))
    if kind == "frozen":
        return torch.nn.Linear(DRAWN_DIM, DRAWN_DIM).requires_grad_(False)
    if kind == "norm":
        return torch.nn.RMSNorm(DRAWN_DIM)
    if kind == "squared":
        return Squared(g)
    layer = qf.LoRALinear.from_linear(torch.nn.Linear(DRAWN_DIM, DRAWN_DIM), rank=2, compile=False)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1, generator=g)  # so that lora_A has a gradient too
    return layer


class TwoLayers(torch.nn.Module):
    def __init__(self, first, second, mode):
        super().__init__()
        self.first = first
        self.second = second
        self.mode = mode

    def forward(self, x):
        if self.mode == "chain":
            return self.second(self.first(x))
        if self.mode == "one skipped":
            return self.first(x)
        if self.mode == "one twice":
            return self.first(self.first(x))
        if self.mode == "summed":
            return self.first(x) + self.second(x)
        return self.first(x), self.second(x)  # a pair out


class DrawnModel(torch.nn.Module):
    def __init__(self, case, blocks):
        super().__init__()
        self.case = case
        self.embed = torch.nn.Embedding(DRAWN_VOCAB, DRAWN_DIM)
        self.embed.requires_grad_(not case.frozen_embed)
        self.blocks = torch.nn.ModuleList(blocks)
        self.norm = torch.nn.RMSNorm(DRAWN_DIM)
        self.head = torch.nn.Linear(DRAWN_DIM, DRAWN_VOCAB, bias=False)
        if case.tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens, skip_head=False):
        h = self.embed(tokens)
        for i in self.case.schedule:
            if i in self.case.checkpointed:
                out = torch.utils.checkpoint.checkpoint(self.blocks[i], h, use_reentrant=False)
            else:
                out = self.blocks[i](h)
            if isinstance(out, tuple):
                out = out[0] + out[1]
            h = h + out if self.case.residual else out
        h = self.norm(h)
        return h if skip_head else self.head(h)


class DrawnCase:
    """A model, its units and its call pattern, drawn from `seed`."""

    def __init__(self, seed):
        self.seed = seed
        r = random.Random(seed)
        kinds = ["linear", "frozen", "norm", "squared", "lora"]
        modes = ["chain", "one skipped", "one twice", "summed", "a pair out"]
        self.blocks = []  # per block: (kind,) or (kind, kind, mode)
        for _ in range(r.randint(1, 3)):
            if r.random() < 0.4:
                self.blocks.append((r.choice(kinds), r.choice(kinds), r.choice(modes)))
            else:
                self.blocks.append((r.choice(kinds),))
        n = len(self.blocks)
        self.schedule = [i for i in range(n) for _ in range(r.choice([0, 1, 1, 1, 2]))]
        self.checkpointed = {i for i in range(n) if r.random() < 0.25}
        self.residual = r.random() < 0.5
        self.frozen_embed = r.random() < 0.3
        self.tied = r.random() < 0.3
        self.tied_blocks = r.random() < 0.15
        self.pattern = r.choice(DRAWN_PATTERNS)
        self.units = self._draw_units(r)

    def _draw_units(self, r):
        """Lists of module names, each a unit, in a drawn order."""
        names = ["embed"] + [f"blocks.{i}" for i in range(len(self.blocks))] + ["norm", "head"]
        for i, block in enumerate(self.blocks):
            if len(block) == 3 and r.random() < 0.3:
                names.append(f"blocks.{i}.{r.choice(['first', 'second'])}")
        units = []
        for name in names:
            draw = r.random()
            if draw < 0.25:
                continue  # the root's
            if draw < 0.55 and units:
                r.choice(units).append(name)
            else:
                units.append([name])
        if r.random() < 0.7:
            r.shuffle(units)
        return units

    def model(self):
        g = torch.Generator().manual_seed(self.seed)
        torch.manual_seed(self.seed)
        blocks = []
        for block in self.blocks:
            layers = [drawn_layer(kind, g) for kind in block[:2]]
            blocks.append(layers[0] if len(block) == 1 else TwoLayers(*layers, block[2]))
        if self.tied_blocks:
            linears = [b for b in blocks if type(b) is torch.nn.Linear and b.weight.requires_grad]
            if len(linears) >= 2:
                linears[1].weight = linears[0].weight
        return DrawnModel(self, blocks)

    def refusal(self):
        """The words of FSDP's error for these units, or None: a unit that lists a module and one
        inside it; a parameter in two units (tied across them, or the root and a unit)."""
        for unit in self.units:
            for outer in unit:
                if any(inner.startswith(outer + ".") for inner in unit):
                    return "which holds it"
        unit_of = {name: i for i, unit in enumerate(self.units) for name in unit}
        units_of = {}  # id(parameter) -> the units it is found in
        for name, p in self.model().named_parameters(remove_duplicate=False):
            # The nearest listed module above it holds it (the longest name), else the root.
            above = [m for m in unit_of if name.startswith(m + ".")]
            unit = unit_of[max(above, key=len)] if above else -1
            units_of.setdefault(id(p), set()).add(unit)
        return "in two units" if any(len(u) > 1 for u in units_of.values()) else None

    def data(self, world):
        g = torch.Generator().manual_seed(self.seed + 1)
        tokens = torch.randint(DRAWN_VOCAB, (world * DRAWN_ROWS, 4), generator=g)
        targets = torch.randint(DRAWN_VOCAB, (world * DRAWN_ROWS, 4), generator=g)
        return tokens, targets

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"DrawnCase({fields})"


def drawn_loss(logits, targets, scale):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) * scale


def drawn_backward(model, pattern, tokens, targets, scale):
    """One step's backward(s) by `pattern`; scale: the loss's weight."""
    half = tokens.shape[0] // 2
    first, second = slice(0, half), slice(half, None)
    if pattern == "plain":
        drawn_loss(model(tokens), targets, scale).backward()
    elif pattern == "two passes, one backward":
        a = drawn_loss(model(tokens[first]), targets[first], scale)
        b = drawn_loss(model(tokens[second]), targets[second], scale)
        ((a + b) / 2).backward()
    elif pattern == "chunked head":
        h = model(tokens, skip_head=True)
        detached = h.detach().requires_grad_()
        for chunk, y in zip(detached.chunk(2, dim=1), targets.chunk(2, dim=1)):
            (drawn_loss(model.head(chunk), y, scale) / 2).backward()
        h.backward(detached.grad)
    elif pattern == "two forwards, then two backwards":
        a = drawn_loss(model(tokens[first]), targets[first], scale)
        b = drawn_loss(model(tokens[second]), targets[second], scale)
        (a / 2).backward()
        (b / 2).backward()
    elif pattern == "grad_accum":
        for rows in (first, second):
            (drawn_loss(model(tokens[rows]), targets[rows], scale) / 2).backward()
    else:  # an evaluation between the forward and its backward
        loss = drawn_loss(model(tokens), targets, scale)
        with torch.no_grad():
            model(tokens)
        loss.backward()


def drawn_steps(case, rank, world, shard):
    """2 AdamW steps -> ([{name: gradient, NaN if None}] per step, {name: weight} after).
    Sharded: FSDP with the case's units on this rank's rows. Unsharded: torch.optim.AdamW, each
    rank's rows in turn at weight 1 / world (FSDP averages over ranks)."""
    model = case.model()
    tokens, targets = case.data(world)
    if shard:
        modules = dict(model.named_modules())
        fsdp = qf.FSDP(model, [[modules[n] for n in unit] for unit in case.units], device="cpu")
        params = model.parameters()
        rows = [slice(rank * DRAWN_ROWS, (rank + 1) * DRAWN_ROWS)]
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        rows = [slice(r * DRAWN_ROWS, (r + 1) * DRAWN_ROWS) for r in range(world)]
    optimizer = (qf.AdamW if shard else torch.optim.AdamW)(
        params, lr=1e-2, eps=1e-6, weight_decay=0.1
    )
    named = dict(model.named_parameters(remove_duplicate=False))
    grads = []
    for _ in range(2):
        for r in rows:
            drawn_backward(model, case.pattern, tokens[r], targets[r], 1 / len(rows))
        if shard:
            grads.append(fsdp.full_adapters(of=grad_or_nan))
        else:
            grads.append({n: grad_or_nan(p) for n, p in named.items() if p.requires_grad})
        optimizer.step()
        optimizer.zero_grad()
    if shard:
        return grads, fsdp.full_adapters()
    return grads, {n: p.detach().clone() for n, p in named.items() if p.requires_grad}


def drawn_difference(got, want):
    """'' if the sharded steps equal the unsharded ones, else the first difference."""
    pairs = [(f"step {i + 1} gradient", g, w) for i, (g, w) in enumerate(zip(got[0], want[0]))]
    pairs.append(("weight after 2 steps", got[1], want[1]))
    for what, got_tensors, want_tensors in pairs:
        for name, t in got_tensors.items():
            try:
                torch.testing.assert_close(
                    t, want_tensors[name], rtol=1e-5, atol=1e-6, equal_nan=True
                )
            except AssertionError as e:
                return f"{what} of {name}: {' '.join(str(e).split()[:24])}"
    return ""


def drawn_cases(rank, world, seeds):
    """{seed: '' (equal), 'refused: ...' (as expected), or what went wrong} for each case; only
    rank 0 runs the unsharded reference."""
    results = {}
    for seed in seeds:
        case = DrawnCase(seed)
        refusal = case.refusal()
        try:
            got = drawn_steps(case, rank, world, shard=True)
        except ValueError as e:
            matched = refusal is not None and refusal in str(e)
            results[seed] = f"refused: {refusal}" if matched else f"refused wrongly: {e}"
            continue
        except Exception as e:  # the failure is reported with its case, not raised in a rank
            results[seed] = f"{type(e).__name__}: {e}"
            continue
        if refusal is not None:
            results[seed] = f"not refused ({refusal})"
        elif rank == 0:
            results[seed] = drawn_difference(got, drawn_steps(case, 0, world, shard=False))
    return results


def test_parameters_keep_their_names_and_state_dict_keys():
    """After FSDP the trainable parameters are the model's own, by name: named_parameters() and
    state_dict() give the original names (each a 1-D fp32 piece, a view into its unit's flat
    master), and the optimizer steps them in place."""
    model = mlp_stack()
    names = [n for n, _ in model.named_parameters()]
    fsdp = qf.FSDP(model, list(model), device="cpu")
    pieces = dict(model.named_parameters())
    assert list(pieces) == names and list(model.state_dict()) == names
    assert all(p.dim() == 1 and p.dtype == torch.float32 for p in pieces.values())
    unit = fsdp.units[0]
    master = unit.master.untyped_storage().data_ptr()
    assert all(pieces[s.name].untyped_storage().data_ptr() == master for s in unit.adapters)


def test_floating_inputs_are_cast_to_the_compute_dtype():
    """With compute_dtype=torch.bfloat16 an fp32 input is cast at the root's forward (FSDP2's
    cast_forward_inputs, on by default): the output equals the model in bf16 on the bf16 input;
    with cast_forward_inputs=False the fp32 input reaches the bf16 weights as it is."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    ref = mlp_stack().to(torch.bfloat16)
    want = ref(x.to(torch.bfloat16))
    model = mlp_stack()
    qf.FSDP(model, list(model), device="cpu", compute_dtype=torch.bfloat16)
    got = model(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    plain = mlp_stack()
    qf.FSDP(
        plain, list(plain), device="cpu", compute_dtype=torch.bfloat16, cast_forward_inputs=False
    )
    with pytest.raises(RuntimeError, match="dtype"):
        plain(x)


def test_adamw_is_a_drop_in_for_torch():
    """Our AdamW takes torch.optim.AdamW's keywords at their defaults (and foreach=True), refuses
    any other value naming the keyword, and an unknown keyword as torch does; with a tensor lr it
    equals torch's; it continues from a torch.optim.AdamW state_dict as torch does, and torch
    continues from ours as we do; sparse gradients and complex parameters are refused."""
    g = torch.Generator().manual_seed(0)
    p0 = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in p0] for _ in range(6)]

    def run(cls, gs_list, start=p0, state=None, **kw):
        params = [p.detach().clone().requires_grad_() for p in start]
        opt = cls(params, **kw)
        if state is not None:
            opt.load_state_dict(state)
        for gs in gs_list:
            for p, gr in zip(params, gs):
                p.grad = gr.clone()
            opt.step()
        return params, opt

    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    defaults = dict(
        amsgrad=False,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
    )
    want, _ = run(torch.optim.AdamW, grads, **kw)
    for cls_first, cls_then in ((torch.optim.AdamW, qf.AdamW), (qf.AdamW, torch.optim.AdamW)):
        half, opt = run(cls_first, grads[:3], **kw)
        resumed, _ = run(cls_then, grads[3:], start=half, state=opt.state_dict(), **kw)
        for a, b in zip(resumed, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for extra in (defaults, dict(foreach=True), dict(lr=torch.tensor(1e-2))):
        got, _ = run(qf.AdamW, grads, **{**kw, **extra})
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for key, value in (
        ("amsgrad", True),
        ("maximize", True),
        ("foreach", False),
        ("capturable", True),
        ("fused", True),
        ("differentiable", True),
        ("decoupled_weight_decay", False),
    ):
        with pytest.raises(ValueError, match=f"AdamW: {key}={value} is not implemented here"):
            qf.AdamW([torch.zeros(2, requires_grad=True)], **{key: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'momentum'"):
        qf.AdamW([torch.zeros(2, requires_grad=True)], momentum=0.9)
    sparse, complex_ = (
        torch.zeros(4, requires_grad=True),
        torch.zeros(4, dtype=torch.complex64, requires_grad=True),
    )
    sparse.grad = torch.ones(4).to_sparse()
    complex_.grad = torch.ones(4, dtype=torch.complex64)
    for p in sparse, complex_:
        with pytest.raises(
            RuntimeError, match="AdamW does not support sparse gradients or complex parameters"
        ):
            qf.AdamW([p]).step()


# ---- 11. the Llama family, DoRA, generation ------------------------------------------------------


def dora_layer(bias=False, dropout=0.0, dtype=torch.float32, compile=False, seed=0):
    """A DoRALinear (128 -> 96, rank 4) from an nn.Linear, with nonzero B and a magnitude moved
    off W's row norms, so that every term of DoRA's formula shows."""
    torch.manual_seed(seed)
    linear = torch.nn.Linear(128, 96, bias=bias, dtype=dtype)
    layer = qf.DoRALinear.from_linear(linear, rank=4, alpha=8.0, dropout=dropout, compile=compile)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
        layer.lora_magnitude_vector.mul_(1 + 0.2 * torch.rand(96))
    return layer


def dora_reference(layer, x, dropped):
    """DoRA as the paper and PEFT write it, dense and in fp32: V = W + s B A, n = ||V|| row by row
    (detached), y = x W^T + (m / n - 1) d(x) W^T + (m / n) s d(x) A^T B^T + bias, d(x) = dropped."""
    W = layer.weight.dequantize(torch.float32)
    A, B, m = layer.lora_A, layer.lora_B, layer.lora_magnitude_vector
    n = (W + layer.scaling * B.detach() @ A.detach()).norm(dim=1)
    x, dropped = x.float(), dropped.float()
    scale = m / n
    y = x @ W.T + (scale - 1) * (dropped @ W.T) + scale * layer.scaling * (dropped @ A.T @ B.T)
    return y if layer.bias is None else y + layer.bias.float()


def dora_outputs(layer, fn, x, seed=5):
    """fn(x) (..., out) and the gradients of x, A, B and m for a fixed random upstream gradient;
    the global RNG seeded first, so that dropout draws the same mask for each fn."""
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    y = fn(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    params = [layer.lora_A, layer.lora_B, layer.lora_magnitude_vector]
    grads = torch.autograd.grad(y, [x, *params], g)
    return [y.detach(), *grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("bias", [False, True])
def test_dora_linear_equals_the_dense_formula(bias, dropout, dtype):
    """DoRALinear over NF4 (its norm from x W^T's one dequantize, A W^T and A A^T, never a dense
    W + s B A) equals DoRA's dense formula on the dequantized W: the output and the gradients of x,
    A, B and m, to fp32 rounding (bf16: to bf16's), with and without a bias, with dropout (the
    same mask) and without."""
    layer = dora_layer(bias, dropout, dtype)
    layer.train()
    x = torch.randn(3, 5, 128, dtype=dtype)
    got = dora_outputs(layer, layer, x)

    def reference(x):
        dropped = layer.dropout(x) if dropout else x
        return dora_reference(layer, x, dropped)

    want = dora_outputs(layer, reference, x)
    rtol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: 8 bits of mantissa
    for name, a, b in zip(["y", "x", "A", "B", "m"], got, want):
        scale = b.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=rtol * scale, msg=name)


def test_dora_starts_as_the_base_and_merges_as_forward():
    """A fresh DoRALinear (B = 0, m = ||W|| row by row) is exactly its LoRALinear: m / n = 1. Its
    magnitude is its lora_magnitude_vector, fp32 and trainable beside lora_A and lora_B. Trained,
    merged_weight() = (m / n)[:, None] (W + s B A) gives its forward (eval)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96, bias=True)
    x = torch.randn(4, 128)
    lora = qf.LoRALinear.from_linear(linear, rank=4, compile=False)
    dora = qf.DoRALinear.from_linear(linear, rank=4, compile=False)
    with torch.no_grad():
        dora.lora_A.copy_(lora.lora_A)
        assert torch.equal(dora(x), lora(x))
    W = dora.weight.dequantize(torch.float32)
    torch.testing.assert_close(dora.lora_magnitude_vector.detach(), W.norm(dim=1))
    trainable = [n for n, p in dora.named_parameters() if p.requires_grad]
    assert trainable == ["lora_A", "lora_B", "lora_magnitude_vector"]
    assert dora.lora_magnitude_vector.dtype == torch.float32
    layer = dora_layer(bias=True).eval()
    with torch.no_grad():
        merged = F.linear(x, layer.merged_weight(), layer.bias)
        torch.testing.assert_close(layer(x), merged, rtol=1e-5, atol=1e-5)


def dora_outputs_and_saved_weights(layer, fn, x):
    """dora_outputs, and what saved_weights finds saved while they are made."""
    got = []
    found = saved_weights(lambda: got.extend(dora_outputs(layer, fn, x)), [layer.weight.shape])
    return got, found


def test_dora_linear_compiles_fullgraph_and_saves_no_dense_weight():
    """A DoRALinear with compiled kernels compiles with fullgraph=True; eager and compiled, its
    output and gradients equal DoRA's dense formula, and neither saves a dense (96, 128) weight
    for backward."""
    layer = dora_layer(compile=True)
    x = torch.randn(3, 5, 128)
    want = dora_outputs(layer, lambda x: dora_reference(layer, x, x), x)
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        got, found = dora_outputs_and_saved_weights(layer, fn, x)
        assert found == []
        for name, a, b in zip(["y", "x", "A", "B", "m"], got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_sample_equals_stepwise_reference(temperature, monkeypatch):
    """--sample N continues --prompt (comma-separated ids for a model that is not byte-level) one
    token at a time, past --seq_len: the argmax of the whole sequence's last logits at temperature
    0, else a draw from softmax(logits / T) by the --seed generator -- as computed here from the
    trained adapters, without a KV cache."""
    monkeypatch.setitem(
        qf.CONFIGS, "micro-ids", dataclasses.replace(qf.CONFIGS["micro"], vocab_size=320)
    )
    argv = BASE + [
        "--model",
        "micro-ids",
        "--data",
        "dummy",
        "--batch_size",
        "2",
        "--steps",
        "2",
        "--seq_len",
        "8",
    ]
    sample = ["--sample", "8", "--prompt", "5, 17,300", "--temperature", str(temperature)]
    summary, _, fsdp = qf.fine_tune(qf.parse_args(argv + sample))
    model, ref = build(qf.parse_args(argv), qf.CONFIGS["micro-ids"])
    for name, t in fsdp.full_adapters().items():
        ref.load_full(name, t)
    ids, g = [5, 17, 300], qf.seeded(qf.parse_args(argv).seed, "sample")
    with torch.no_grad():
        for _ in range(8):  # 3 + 8 tokens, more than --seq_len
            logits = model(torch.tensor([ids]))[0, -1].float()
            probs = torch.softmax(logits / temperature, -1) if temperature else None
            ids.append(
                int(torch.multinomial(probs, 1, generator=g))
                if temperature
                else int(logits.argmax())
            )
    assert summary["sample"] == ids[3:]


@pytest.mark.parametrize("world", [2, 3])
def test_sample_same_on_two_ranks(world, tmp_path):
    """Sharded over 2 or 3 ranks, --sample (with the KV cache, here drawn at temperature 0.8 from
    the --seed generator) gives the single process's text on every rank."""
    argv = BASE + ["--steps", "1", "--sample", "16", "--prompt", "def ", "--temperature", "0.8"]
    single, _, _ = qf.fine_tune(qf.parse_args(argv + ["--batch_size", "6"]))
    assert isinstance(single["sample"], str) and single["sample"]
    for r in run_sharded(world, argv + ["--batch_size", str(6 // world)], tmp_path):
        assert r["summary"]["sample"] == single["sample"]


def test_sampling_at_a_tiny_temperature_is_greedy():
    """Drawing at temperature 1e-40 picks the most likely token every time, as greedy decoding
    does (the logits / T overflow float32; the softmax runs in float64)."""
    model = make_model()
    greedy = model.generate([10, 20, 30], 8)
    assert model.generate([10, 20, 30], 8, temperature=1e-40) == greedy


def generation_model(family, dora=False, seed=0):
    """A tiny CausalLM of the family (fp32), its adapters, biases and norms made nonzero."""
    torch.manual_seed(seed)
    model = qf.CausalLM(family_config(family), dtype=torch.float32, compile=False, dora=dora)
    randomize_dense(model, seed)
    return model


@pytest.mark.parametrize("family", list(FAMILIES) + ["part one's llama", "llama, dora"])
def test_cached_logits_equal_the_whole_sequences(family):
    """With the KV cache, the prompt's forward and each one-token forward after it give the logits
    of a forward over the whole sequence so far, at every position (fp32, 1e-5 of their scale):
    for each family (GQA, biases, Qwen3's q/k norms), Part I's plain Llama and DoRA."""
    if family == "part one's llama":
        torch.manual_seed(0)
        model = qf.Llama(qf.CONFIGS["tiny"], dtype=torch.float32)
        randomize_dense(model)
    else:
        model = generation_model(family.removesuffix(", dora"), dora=family.endswith("dora"))
    model.eval()
    ids = torch.randint(256, (1, 12), generator=torch.Generator().manual_seed(1))
    cache = qf.KVCache(12)
    with torch.no_grad():
        got = [model(ids[:, :7], positions=torch.arange(7), mask=cache)]
        cache.filled = 7
        for i in range(7, 12):
            got.append(model(ids[:, i : i + 1], positions=torch.arange(i, i + 1), mask=cache))
            cache.filled += 1
        want = model(ids)
    got = torch.cat(got, dim=1)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_with_the_cache_equals_without(family, temperature):
    """Llama.generate with its KV cache gives, token for token, what the cache-free path (the
    whole sequence again for each token) gives: greedy, and drawn at the same seed."""
    model = generation_model(family)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    cached = model.generate(prompt, 16, temperature=temperature, seed=7)
    plain = model.generate(prompt, 16, temperature=temperature, seed=7, cache=False)
    assert cached == plain and len(cached) == 16


def test_generate_stops_at_a_stop_id_and_keeps_the_models_mode():
    """generate stops at the first new id in `stop` and returns it last; it runs in eval mode (a
    LoRA dropout would change the tokens), then puts the model back in the mode it was in, and
    the model then computes what one that never generated computes (the cache is gone)."""
    model = generation_model("llama")
    for m in model.modules():
        if isinstance(m, qf.LoRALinear):
            m.dropout = torch.nn.Dropout(0.5)
    model.train()
    greedy = model.generate([3, 1, 4], 10)
    assert model.training and len(greedy) == 10
    model.eval()
    assert model.generate([3, 1, 4], 10) == greedy
    stop = greedy[4]
    first = greedy.index(stop)
    assert model.generate([3, 1, 4], 10, stop=[stop, 10**6]) == greedy[: first + 1]
    tokens = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(0))
    fresh = generation_model("llama").eval()
    torch.testing.assert_close(model(tokens, tokens), fresh(tokens, tokens), rtol=0, atol=0)


def test_generate_on_the_compiled_path_runs_blocks_eagerly_and_kernels_compiled(monkeypatch):
    """On --compile's path (compiled NF4 kernels, each block's forward compiled on the instance),
    generate gives the eager model's tokens; it runs each block's class forward (a compiled one
    would compile for every new length) and puts the compiled ones back after; and the NF4
    kernels run compiled, also in a model that never trained (a compile stance must not turn
    them eager)."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = generation_model("llama").generate(prompt, 12)
    torch.manual_seed(0)
    model = qf.CausalLM(family_config("llama"), dtype=torch.float32, compile=True)
    randomize_dense(model)

    def compiled_forward(*args, **kwargs):
        raise AssertionError("a block's compiled forward ran while generating")

    for layer in model.model.layers:
        layer.forward = compiled_forward
    calls = []
    real = qf._dequantize_compiled
    monkeypatch.setattr(qf, "_dequantize_compiled", lambda *a: calls.append(1) or real(*a))
    stances = []  # eager_on_recompile would run a kernel never compiled before eagerly
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: stances.append(a))
    assert model.generate(prompt, 12) == want
    assert all(vars(layer)["forward"] is compiled_forward for layer in model.model.layers)
    assert len(calls) >= 7 * 4 * 12 and stances == []  # every projection, every token


@pytest.mark.parametrize("shard", ["FullyShard", "FSDP"])
def test_generate_on_part_ones_llama_sharded_equals_it_whole(shard):
    """Llama.generate with the KV cache on Part I's Llama sharded by FullyShard or FSDP (world 1)
    gives the tokens of the same model whole, with the cache and without (it used to copy the
    sharded state dict into a whole model, and fail on its shapes)."""
    models = []
    for _ in range(2):
        model = make_model(compile=False)
        randomize_dense(model)
        models.append(model)
    whole, sharded = models
    cls = qf.FullyShard if shard == "FullyShard" else qf.FSDP
    cls(sharded, sharded.units(), "cpu", torch.float32)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = whole.generate(prompt, 12)
    assert sharded.generate(prompt, 12) == want == sharded.generate(prompt, 12, cache=False)


def test_generate_refuses_more_than_a_sliding_window():
    """A prompt and new tokens beyond Mistral v0.1's sliding_window are refused, not attended
    past the window without a word."""
    torch.manual_seed(0)
    config = family_config("mistral", sliding_window=16)
    model = qf.CausalLM(config, dtype=torch.float32, compile=False)
    with pytest.raises(ValueError, match="20 tokens exceed the model's sliding_window of 16"):
        model.generate(list(range(10)), 10)
    assert len(model.generate(list(range(10)), 6)) == 6


def test_flex_attention_mask_equals_the_dense_one():
    """The CUDA path's flex_attention block mask (documents on one side of a row, a GQA block)
    gives the CPU path's dense-mask attention (forward: flex has no CPU backward)."""
    torch.manual_seed(0)
    attention = qf.CausalLM(qf.CONFIGS["tiny"], dtype=torch.float32, compile=False).model.layers[0]
    attention = attention.self_attn
    positions = [[*range(50), *range(60), *range(18)], [*range(128)]]
    positions = torch.tensor(positions)
    documents = torch.tensor([[0] * 50 + [1] * 60 + [2] * 18, [0] * 128])
    dense = qf.document_mask(positions)

    def same_document_causal(b, h, q, kv):
        return (documents[b, q] == documents[b, kv]) & (q >= kv)

    block_mask = qf.create_block_mask(same_document_causal, 2, None, 128, 128, device="cpu")
    cos, sin = qf.rope_cos_sin(qf.CONFIGS["tiny"], positions, torch.float32)
    cos, sin = cos[:, None], sin[:, None]
    x = torch.randn(2, 128, 128)
    with torch.no_grad():
        flex = attention(x, cos, sin, block_mask)
        torch.testing.assert_close(flex, attention(x, cos, sin, dense))
    assert dense[0, 0, 49, :50].all() and not dense[0, 0, 50, :50].any()


# ---- 12. long context: each sequence split across the ranks --------------------------------------


def _runs_worker(rank, world, port, argvs, out_path):
    """A rank that runs fine_tune for each argv in turn: one spawned world for several runs."""
    _become_rank(rank, world, port)
    results = []
    for argv in argvs:
        summary, losses, fsdp = qf.fine_tune(qf.parse_args(argv))
        results.append(dict(summary=summary, losses=losses, adapters=fsdp.full_adapters()))
        if "--sample" in argv:  # and without the cache, each step the whole sequence
            model = fsdp.root.modules[0]
            prompt = [5, 17, 100, 9, 31, 2]
            for cache in (True, False):
                results[-1][cache] = qf.generate(model, prompt, 6, cache=cache)
    torch.save(results, f"{out_path}.{rank}")
    torch.distributed.destroy_process_group()


def run_in_one_world(world, argvs, tmp_path):
    """Rank 0's results of each argv, run in turn by one spawned world."""
    out = str(tmp_path / f"runs{world}")
    spawn(_runs_worker, (world, free_port(), argvs, out), world)
    return torch.load(f"{out}.0")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return tiny_qwen2(tmp_path_factory.mktemp("qwen2"))


def tiny_qwen2(folder):
    """A tiny Qwen2 checkpoint in folder: grouped-query attention (4 heads, 2 kv) and q, k and v
    biases."""
    path = os.path.join(folder, "tiny-qwen2")
    config = family_config("qwen2")
    write_hf_checkpoint(path, config, hf_state_dict(config))
    return path


def test_context_parallel_equals_the_run_without_it(tmp_path, qwen2_dir):
    """--context_parallel: the loss at every step and the adapters after them (eps 1: the
    gradients) equal one process's run of the same global batch, to fp32 rounding. At world 2
    (N = 2): with --grad_accum, --offload_activations, --dora and --val_data (the held-out
    loss too); without checkpointing, packed
    (documents masked across the pieces); a Qwen2 checkpoint (GQA, biases; its greedy sample,
    with the KV cache and without, equals the unsplit one); compiled and with --tile_tokens (both
    against the plain eager run, as each equals it unsplit); and a run
    stopped with N = 2 and resumed with N = 1 (then 2 ranks of 1 row). At world 4: N = 4 (2 kv
    heads repeated to 4) and N = 2 with two groups."""
    argv = BASE + ["--batch_size", "2", "--steps", "3"]
    cases = {
        "accum, offload, dora, val": ["--grad_accum", "2", "--offload_activations", "--dora"]
        + ["--val_data", qf.__file__, "--eval_seqs", "3"],
        "packed": ["--no-checkpointing", "--data", packed_file(tmp_path)] + PACK,
        "qwen2": ["--checkpoint", qwen2_dir, "--sample", "6", "--prompt", "5, 17,100"],
        "compiled": ["--compile"],
        "tiles": ["--tile_tokens", "8"],
    }
    split = [argv + flags + ["--context_parallel", "2"] for flags in cases.values()]
    out = ["--out", str(tmp_path / "run"), "--save_every", "2"]
    split.append(argv + out + ["--stop_at", "2", "--context_parallel", "2"])
    split.append(argv + out + ["--resume", "--batch_size", "1"])
    *got, stopped, resumed = run_in_one_world(2, split, tmp_path)
    plain = run_single(argv)
    for result, (case, flags) in zip(got, cases.items()):
        if case in ("compiled", "tiles"):
            assert_same_run(result, plain)
            continue
        summary, losses, fsdp = qf.fine_tune(qf.parse_args(argv + flags))
        assert_same_run(result, dict(losses=losses, adapters=fsdp.full_adapters()))
        if "--val_data" in flags:
            want = pytest.approx(summary["val_loss"], rel=1e-5)
            assert result["summary"]["val_loss"] == want
        if "--sample" in flags:  # whole sequences, the split set aside; with the cache and not
            assert result["summary"]["sample"] == summary["sample"]
            assert result[False] == result[True]
    resumed["losses"] = stopped["losses"] + resumed["losses"]
    assert_same_run(resumed, plain)
    four = [argv + ["--context_parallel", "4"], argv + ["--context_parallel", "2"]]
    got = run_in_one_world(4, four, tmp_path)
    assert_same_run(got[0], plain)
    assert_same_run(got[1], run_single(argv + ["--batch_size", "4"]))


@pytest.mark.parametrize(
    "env,argv,words",
    [
        ({}, ["--seq_len", "33"], "--context_parallel 2: does not divide --seq_len 33"),
        ({}, [], "--context_parallel 2: does not divide the 1 ranks"),
        ({"WORLD_SIZE": "6"}, ["--seq_len", "96", "--context_parallel", "3"], "the model's 4"),
        ({"WORLD_SIZE": "4"}, ["--shard_size", "2", "--context_parallel", "4"], "lie within"),
    ],
    ids=["seq_len", "world", "heads", "shard_size"],
)
def test_context_parallel_that_cannot_split_is_one_line(env, argv, words, monkeypatch, capsys):
    """A --context_parallel that does not divide the sequence, the ranks or the heads, or whose
    groups would span --shard_size's, is refused in one line (at world 1 by a run, at other
    worlds by --estimate, as torchrun's WORLD_SIZE says)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    flags = ["--context_parallel", "2"] + argv + (["--estimate"] if env else [])
    with pytest.raises(SystemExit) as exc:
        qf.main(BASE + flags)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and words in err and len(err.splitlines()) == 1


def test_context_parallel_divides_the_activations():
    """The estimate of N pieces of rows of T tokens keeps what one rank keeps of rows of T / N,
    and in a block's backward the all-to-alls' copies of q, k and v (plus, packed, the masks of
    the whole rows), the state unchanged."""
    config = qf.CONFIGS["llama3-8b"]
    split = qf.estimate_memory(
        config, qf.Plan(shard=2, batch_size=1, seq_len=65536, context_parallel=4)
    )
    piece = qf.estimate_memory(config, qf.Plan(shard=2, batch_size=1, seq_len=16384))
    copies = 16384 * 2 * (4096 + 2 * 1024)  # bf16 q, k and v of the piece's tokens
    assert split.activation_peak == piece.activation_peak + copies
    assert split.state == piece.state
    packed = qf.estimate_memory(
        config, qf.Plan(shard=2, batch_size=1, seq_len=65536, context_parallel=4, pack=True)
    )
    assert packed.activation_peak > split.activation_peak + 65536**2  # the whole rows' mask


class _GPTAttention(torch.nn.Module):
    """GPT-2's attention, with the contract section 12 states: attend(q, k, v, mask), mask
    None for causal, and q, k, v handed to a mask that has an attend method."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x, mask):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.heads, C // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, heads, T, hd)
        if hasattr(mask, "attend"):
            y = mask.attend(self, q, k, v)
        else:
            y = self.attend(q, k, v, mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def attend(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, mask, is_causal=mask is None)


class _GPT(torch.nn.Module):
    """A GPT-2-like model, not Llama: learned positions, LayerNorm, a fused qkv, GELU."""

    def __init__(self, vocab=97, d=64, heads=4, layers=2, max_len=64):
        super().__init__()
        torch.manual_seed(1)
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(max_len, d)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(d) for _ in range(layers))
        self.attns = torch.nn.ModuleList(_GPTAttention(d, heads) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)
        self.context_parallel = None  # a ContextParallel: the rows are this rank's pieces

    def forward(self, batch):
        """The sum of the cross entropy over the batch's targets."""
        T = batch.inputs.shape[1]
        positions = batch.positions
        mask = None
        if self.context_parallel is not None:
            positions, mask = self.context_parallel.rows(positions, T, "cpu")
        elif positions is not None:
            mask = qf.document_mask(positions)
        x = self.wte(batch.inputs) + self.wpe(torch.arange(T) if positions is None else positions)
        for norm, attention in zip(self.norms, self.attns):
            x = x + attention(norm(x), mask)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="sum")


def _gpt_batches():
    """Two rows of 64 tokens: plain, and packed with documents that cross the split at 32."""
    tokens = torch.randint(97, (2, 65), generator=torch.Generator().manual_seed(0))
    lengths = [[20, 30, 14], [40, 24]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    return [(tokens[:, :-1], tokens[:, 1:], None), (tokens[:, :-1], tokens[:, 1:], positions)]


def _section_12_alone():
    """Section 12's text as a module of its own, with the four names it reads from above."""
    names = "from qlora_fsdp import Batch, document_mask, require, world_and_rank"
    return exec_module("lifted_long_context", lifted([12]) + "\n" + names)


def _gpt_split_worker(rank, world, port, out_path):
    _become_rank(rank, world, port)
    torch.distributed.init_process_group("gloo")
    section = _section_12_alone()
    results = []
    for batch in _gpt_batches():
        model = _GPT()
        model.context_parallel = section.context_groups(world)
        piece = section.piece_of(section.Batch(*batch), world, rank)
        loss = model(piece)
        loss.backward()
        torch.distributed.all_reduce(loss)
        for p in model.parameters():  # replicated weights: the sum over the group
            torch.distributed.all_reduce(p.grad)
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    torch.save(results, f"{out_path}.{rank}")
    torch.distributed.destroy_process_group()


def test_section_12_alone_splits_a_model_of_your_own(tmp_path):
    """Section 12 pasted alone (with the four names it reads from sections 8 and 11) splits
    each row of a GPT-2-like model of one's own (learned positions, a fused qkv, LayerNorm)
    over 2 ranks: the loss and every gradient equal one process's on the whole rows, plain
    and packed (documents crossing the pieces' boundary)."""
    out = str(tmp_path / "gpt")
    spawn(_gpt_split_worker, (2, free_port(), out), 2)
    got = torch.load(f"{out}.0")
    for (loss, grads), batch in zip(got, _gpt_batches()):
        model = _GPT()
        want = model(qf.Batch(*batch))
        want.backward()
        assert loss == pytest.approx(want.item(), rel=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


# ---- 13. predicting the peak, and what a step keeps for backward ---------------------------------


# A 512-wide model whose activations (4 x 512 tokens: 2048 rows) outweigh its weights, and
# whose activation shapes cannot be mistaken for a weight's (512, 256, 1536, 8192).
MEM = qf.LlamaConfig(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
)


MEM_ARGV = [
    "--model",
    "mem",
    "--batch_size",
    "4",
    "--seq_len",
    "512",
    "--device",
    "cpu",
    "--data",
    "dummy",
]


def _allocated_peak(fn):
    """(result, peak, end) of the bytes fn allocates, from the profiler's allocator events. The
    garbage of what ran before (cycles, which the collector frees at any moment: inside fn, a
    free of bytes fn never allocated) is collected first, and not again until fn is done."""
    gc.collect()
    gc.disable()
    try:
        with torch.profiler.profile(profile_memory=True) as prof:
            out = fn()
    finally:
        gc.enable()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    total = peak = 0
    for _, n in events:
        total += n
        peak = max(peak, total)
    return out, peak, total


def _mem_model(args):
    """(model, fsdp, inputs, targets): the MEM model built by args, and its first batch."""
    model, fsdp = build(args, MEM)
    x, y, _ = qf.get_batch(None, 0, 0, args, 1, 0, MEM.vocab_size)
    return model, fsdp, x, y


def _saved_for_backward(args, model, fsdp, x, y):
    """A first real step of the MEM model: (plain tensors shaped like a base weight that autograd
    saved, the shapes of all it saved, whether every master has a gradient). With eager
    checkpointing, what each block's recompute saves is recorded too (compiled, the recompute is
    part of the block's backward graph, which
    test_compiled_block_is_one_graph_holding_no_dense_weight reads)."""
    # RMSNorm's 1-D weights are dense
    shapes = {p.shape for _, p in fsdp.param_of.values() if not p.trainable and len(p.shape) == 2}
    shapes |= {s[::-1] for s in shapes} | {(math.prod(s),) for s in shapes}  # transposed or flat
    found, seen = [], []

    def record(t):
        seen.append(tuple(t.shape))
        # not packed codes
        if type(t) is torch.Tensor and t.is_floating_point() and tuple(t.shape) in shapes:
            found.append(tuple(t.shape))

    @contextlib.contextmanager
    def recompute_recorder():  # inside a checkpoint's recompute: record, then hand on to its hook
        pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (record(t), pack(t))[1], unpack):
            yield

    real = qf.checkpoint
    if not args.compile:
        qf.checkpoint = lambda *a, **k: real(
            *a, context_fn=lambda: (contextlib.nullcontext(), recompute_recorder()), **k
        )
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (record(t), t)[1], lambda t: t):
            model(x, y).backward()
    finally:
        qf.checkpoint = real
    return found, seen, all(p.grad is not None for p in fsdp.parameters())


def _step_memory(args, built=None):
    """(bytes the allocator peaks at in a step after a first one, bytes the estimate predicts).
    built: _mem_model's (model, fsdp, x, y) after a first step, else built and stepped here."""
    model, _, x, y = built or _mem_model(args)
    if built is None:
        model(x, y).backward()  # the first step's allocations, made once
    loss, forward_peak, forward_end = _allocated_peak(lambda: model(x, y))
    _, backward_peak, _ = _allocated_peak(loss.backward)
    est = qf.estimate_memory(MEM, qf.Plan.of(args, 1))
    return max(forward_peak, forward_end + backward_peak), est.activation_peak + est.gathers


# (compiled blocks, checkpointing)
PATHS = [(True, True), (True, False), (False, True), (False, False)]


DORA_PATHS = [(True, True), (False, True), (False, False)]


DROPOUT_PATHS = [(True, True), (True, False), (False, True)]  # (DoRA, checkpointing), eager


def _packed_step_memory(folder, dtype, checkpointing):
    """[(peak, predicted) packed, (peak, predicted) unpacked] of an eager step of MEM on the same
    documents (lengths 20-300, EOS 8191)."""
    rng = np.random.default_rng(0)
    ids = []
    while len(ids) < 20000:
        ids += rng.integers(0, 8000, int(rng.integers(20, 300))).tolist() + [8191]
    path = os.path.join(folder, "docs.npy")
    np.save(path, np.array(ids, dtype=np.uint16))
    qf.COMPILE = False
    measured = []
    for pack in (True, False):
        argv = MEM_ARGV[:-2] + ["--data", path, "--dtype", dtype, "--no-compile"]
        argv.append("--checkpointing" if checkpointing else "--no-checkpointing")
        args = qf.parse_args(argv + (["--pack", "--eos_id", "8191"] if pack else []))
        model, _ = build(args, MEM)
        data = qf.load_tokens(path, MEM.vocab_size)
        if pack:
            data = qf.PackedDocuments(data, 8191, args.seq_len, 0)
        b = batch_of(data, 0, 0, args, 1, 0, MEM.vocab_size)
        model(b.inputs, b.targets, positions=b.positions).backward()  # first-time allocations
        step = functools.partial(model, b.inputs, b.targets, positions=b.positions)
        loss, forward_peak, forward_end = _allocated_peak(step)
        _, backward_peak, _ = _allocated_peak(loss.backward)
        est = qf.estimate_memory(MEM, qf.Plan.of(args, 1))
        measured.append(
            (max(forward_peak, forward_end + backward_peak), est.activation_peak + est.gathers)
        )
    return measured


@functools.cache  # one answer for all the checks a process makes
def mem_dtype():
    """bf16 where this CPU multiplies it at least a quarter as fast as fp32 (AMX, AVX-512 BF16),
    else fp32: emulated, bf16 is 60x slower there, and the memory checks would take half an
    hour instead of a minute. The estimate follows either."""
    torch.manual_seed(0)
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(256, 256, dtype=dtype)
        a @ a
        start = time.perf_counter()
        for _ in range(4):
            a @ a
        seconds[dtype] = time.perf_counter() - start
    return "bf16" if seconds[torch.bfloat16] < 4 * seconds[torch.float32] else "fp32"


@beside("mem_runs")
def memory_checks(folder):
    """The MEM checks beside the tests, as a training run compiles its blocks for one shape only
    (a block graph dynamo recompiles for a second shape saves other tensors)."""
    qf.CONFIGS["mem"] = MEM
    out = {"dtype": mem_dtype()}
    for compile, checkpointing in PATHS:
        argv = MEM_ARGV + ["--dtype", out["dtype"]]
        argv.append("--compile" if compile else "--no-compile")
        argv.append("--checkpointing" if checkpointing else "--no-checkpointing")
        # as train() sets it: the NF4 kernels and the loss follow --compile too
        qf.COMPILE = compile
        for dora in ([], ["--dora"]) if (compile, checkpointing) in DORA_PATHS else ([],):
            args = qf.parse_args(argv + dora)
            built = _mem_model(args)
            out[" ".join(["saved"] + dora), compile, checkpointing] = _saved_for_backward(
                args, *built
            )
            out[" ".join(["memory"] + dora), compile, checkpointing] = _step_memory(args, built)
    qf.COMPILE = False
    eager = MEM_ARGV + ["--dtype", out["dtype"], "--no-compile"]
    for dora, checkpointing in DROPOUT_PATHS:
        argv = eager + ["--lora_dropout", "0.1"] + ["--dora"] * dora
        argv.append("--checkpointing" if checkpointing else "--no-checkpointing")
        out["dropout", dora, checkpointing] = _step_memory(qf.parse_args(argv))
    return out


@pytest.fixture(scope="module")
def mem_runs(beside_result):
    return beside_result(memory_checks)


@pytest.mark.parametrize("compile,checkpointing", PATHS)
def test_training_step_saves_no_dense_weight(compile, checkpointing, mem_runs):
    """The real step (sharded units, bf16 or fp32 by mem_dtype, blocks compiled or eager, with or
    without activation checkpointing) saves no plain tensor shaped like a base weight for
    backward: NF4 weights stay 4-bit between forward and backward (inside each block's recompute
    too)."""
    found, seen, all_grads = mem_runs["saved", compile, checkpointing]
    assert found == []
    assert len(seen) > 10 and (4, 512, 512) in seen  # the recorder sees inside the blocks
    assert all_grads


@pytest.mark.parametrize("compile,checkpointing", [(True, True), (False, True), (False, False)])
def test_estimate_matches_measured_activations(compile, checkpointing, mem_runs):
    """The estimate's activation and all-gather rows are within 10% of the peak the allocator
    actually sees during a training step (CPU, mem_dtype's, one rank): the default path (blocks
    compiled, checkpointing), and eager blocks with and without checkpointing."""
    measured, predicted = mem_runs["memory", compile, checkpointing]
    assert abs(predicted - measured) <= 0.1 * measured, (predicted / 2**20, measured / 2**20)


@pytest.mark.parametrize("compile,checkpointing", DORA_PATHS)
def test_a_dora_step_saves_no_dense_weight_and_stays_inside_its_estimate(
    compile, checkpointing, mem_runs
):
    """With --dora, the real step (as in the two tests above) saves no dense base weight for
    backward, gives every master a gradient, and its peak is within 10% of the estimate, which
    counts DoRA's own saves (each projection's output before the magnitude's scale)."""
    found, seen, all_grads = mem_runs["saved --dora", compile, checkpointing]
    assert found == [] and all_grads
    measured, predicted = mem_runs["memory --dora", compile, checkpointing]
    assert abs(predicted - measured) <= 0.1 * measured, (predicted / 2**20, measured / 2**20)


@pytest.mark.parametrize("dora,checkpointing", DROPOUT_PATHS, ids=["dora", "dora-nock", "lora"])
def test_a_step_with_lora_dropout_stays_inside_its_estimate(dora, checkpointing, mem_runs):
    """With --lora_dropout, an eager step (MEM, mem_dtype's, one rank, with and without
    checkpointing) peaks within 10% of the estimate, which counts each projection's dropped input
    and mask, and with DoRA its x and d(x) stacked into one NF4 matmul and the three outputs its
    scale keeps (uncounted, DoRA's peak was 1.9x the estimate)."""
    measured, predicted = mem_runs["dropout", dora, checkpointing]
    assert abs(predicted - measured) <= 0.1 * measured, (predicted / 2**20, measured / 2**20)


def test_estimate_bounds_compiled_blocks_without_checkpointing(mem_runs):
    """Compiled without checkpointing, inductor recomputes cheap ops instead of saving them: the
    estimate, counting eager's saves, is an upper bound of the peak the allocator sees."""
    measured, predicted = mem_runs["memory", True, False]
    assert predicted >= measured, (predicted / 2**20, measured / 2**20)


def test_estimate_counts_the_real_all_gather_buffers():
    """The estimate's all-gather row is two of a block unit's all-gathered buffers, each the bytes
    FSDP actually lays out for the unit (within the NF4 scale factors and mean per tensor); its
    sharded rows at world 2 are half of world 1's."""
    args = qf.parse_args(BASE + ["--batch_size", "2"])  # fp32
    _, fsdp = build(args, qf.CONFIGS["tiny"])
    unit = fsdp.units[1]  # a block
    est = qf.estimate_memory(qf.CONFIGS["tiny"], qf.Plan(dtype="fp32"))
    # NF4's scale factors and mean
    assert abs(est.gathers / 2 - unit.unit_bytes) <= len(unit.slots) * 8
    half = qf.estimate_memory(qf.CONFIGS["tiny"], qf.Plan(dtype="fp32", shard=2))
    for row, v in est.state.items():
        assert half.state[row] == pytest.approx(v / 2), row


def test_cublas_workspaces_follow_the_gpu_and_the_variable(monkeypatch):
    """The estimate's cuBLAS row: two matmul threads' workspaces, torch's default by compute
    capability (32 MiB on sm90, :4096:2:16:8 = 8.125 MiB elsewhere; Hopper's when no GPU is
    known), or CUBLAS_WORKSPACE_CONFIG's pairs; the estimate's peak counts them."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert qf.cublas_workspaces((9, 0))[0] == 2 * 32 * 2**20
    assert qf.cublas_workspaces((8, 0)) == (
        2 * 8320 * 2**10,
        "torch's default for sm80, :4096:2:16:8",
    )
    assert qf.cublas_workspaces()[0] == 2 * 32 * 2**20
    assert "assumed" in qf.cublas_workspaces()[1]
    hopper = qf.estimate_memory(qf.CONFIGS["tiny"], capability=(9, 0))
    ampere = qf.estimate_memory(qf.CONFIGS["tiny"], capability=(8, 0))
    assert hopper.gpu_peak - ampere.gpu_peak == 2 * (32 * 2**20 - 8320 * 2**10)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8:1024:4")
    assert qf.cublas_workspaces((9, 0)) == (
        2 * (8192 + 128 + 4096) * 2**10,
        "CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8:1024:4",
    )


def test_estimate_cli_and_resident_weights(monkeypatch, capsys):
    """--estimate answers from the config alone (WORLD_SIZE from the environment, no process
    group): the 7B talk benchmark at world 2 ends with a JSON line holding predicted_peak_gib;
    for a real run its weight rows match the bytes each rank actually keeps (within 5%)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    qf.main(["--model", "llama2-7b", "--batch_size", "8", "--seq_len", "2048", "--estimate"])
    out = capsys.readouterr().out
    s = last_json(out)
    assert s["world_size"] == 2 and 4 < s["predicted_peak_gib"] < 16
    assert "checkpointed block inputs" in out and "predicted peak per GPU" in out
    monkeypatch.setenv("WORLD_SIZE", "1")
    est = qf.estimate_memory(qf.CONFIGS["tiny"], qf.Plan(dtype="fp32"))
    weights = sum(v for k, v in est.state.items() if "gradients" not in k and "AdamW" not in k)
    run = run_single(BASE + ["--batch_size", "2", "--steps", "1"])
    assert abs(weights - run["local_bytes"]) < 0.05 * run["local_bytes"]


@pytest.mark.parametrize("nf4_head", [False, True], ids=["dense head", "nf4 head"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_estimate_counts_each_familys_weights(family, nf4_head, monkeypatch):
    """The estimate's NF4 and dense weight rows are the bytes a built, sharded model of each
    family keeps (biases, q/k norms, a head_dim of its own, a tied head kept apart), with the
    lm_head dense (the default) or NF4 (--nf4_head): NF4 within 1% (the scale groups' padding),
    the dense weights exactly."""
    monkeypatch.setitem(qf.CONFIGS, "fam", family_config(family))
    args = qf.parse_args(BASE + ["--model", "fam"] + ["--nf4_head"] * nf4_head)
    _, fsdp = build(args, qf.CONFIGS["fam"])
    kept = {"nf4": 0, "dense": 0}
    for unit in fsdp.all_units:
        for p in unit.params:
            if not p.trainable:
                kept["nf4" if p.subclass else "dense"] += sum(s.nbytes for s in p.slots)
    est = qf.estimate_memory(qf.CONFIGS["fam"], qf.Plan.of(args, 1)).state
    assert est["NF4 weights (shard)"] == pytest.approx(kept["nf4"], rel=0.01)
    assert est["frozen dense weights (shard)"] == kept["dense"]


def fit_json(argv, world, capsys, monkeypatch):
    """--estimate's JSON line for argv at this world size."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    capsys.readouterr()
    qf.main(argv + ["--estimate"])
    return last_json(capsys.readouterr().out)


@pytest.mark.parametrize("model", ["llama2-7b", "llama3-8b", "llama2-70b"])
def test_fit_plans_fit_keep_the_batch_and_never_get_slower_with_more_memory(
    model, capsys, monkeypatch
):
    """For 7B, 8B and 70B at world 1, 2 and 8 and budgets from 0.5 to 80 GiB per GPU, --estimate
    --fit's plan fits the budget, keeps this rank's batch (micro-batch x grad_accum = 8), is
    --estimate's prediction with the plan's flags given by hand, and a larger budget never picks a
    plan later (slower) in fit_plans' order, every plan before it not fitting; a budget nothing fits
    is one error naming the smallest peak (the list's last plan)."""
    # the host's memory: test_fit_weighs_the_host_memory_too
    monkeypatch.setattr(qf, "host_available", lambda: None)
    argv = ["--model", model, "--batch_size", "4", "--grad_accum", "2", "--seq_len", "2048"]
    plans = qf.fit_plans(qf.Plan.of(qf.parse_args(argv), 1))
    peaks = {}
    for world in (1, 2, 8):
        for i, plan in enumerate(plans):
            hand = [
                "--batch_size",
                str(plan.batch_size),
                "--grad_accum",
                str(plan.grad_accum),
                "--checkpointing" if plan.checkpointing else "--no-checkpointing",
            ]
            hand += ["--offload_activations"] * plan.offload_activations
            hand += ["--cpu_offload"] * plan.cpu_offload
            hand += ["--tile_tokens", str(plan.tile_tokens)] * bool(plan.tile_tokens)
            peaks[world, i] = fit_json(
                argv[:2] + ["--seq_len", "2048"] + hand, world, capsys, monkeypatch
            )
        last, refused = len(plans), 0
        for budget in (0.5, 4, 6, 8, 12, 16, 24, 40, 80):
            try:
                got = fit_json(argv + ["--fit", str(budget)], world, capsys, monkeypatch)
            except SystemExit as e:
                assert e.code == 2 and peaks[world, len(plans) - 1]["predicted_peak_gib"] > budget
                said = re.search(
                    r"the smallest predicted peak is ([\d.]+) GiB", capsys.readouterr().err
                )
                assert (
                    said
                    and abs(float(said[1]) - peaks[world, len(plans) - 1]["predicted_peak_gib"])
                    <= 0.006
                )
                refused += 1
                continue
            i = next(
                i for i, p in enumerate(plans) if all(got[k] == getattr(p, k) for k in qf.FIT_FLAGS)
            )
            assert (
                got["predicted_peak_gib"] <= budget and got["batch_size"] * got["grad_accum"] == 8
            )
            assert got == {**peaks[world, i], "seq_len": 2048}
            assert (
                all(peaks[world, j]["predicted_peak_gib"] > budget for j in range(i)) and i <= last
            )
            last = i
        # 0.5 GiB fits nothing; 80 GiB needs no offload
        assert 0 < refused < 9 and last < len(plans) - 1


def test_fit_weighs_the_host_memory_too(capsys, monkeypatch):
    """A plan whose host memory (the estimate's host row) is more than the machine has is not
    chosen, and the printout says so: Llama-2-70B on one 12 GiB GPU needs --cpu_offload, which 1 GiB
    of host cannot hold."""
    monkeypatch.setattr(qf, "host_available", lambda: qf.GiB)
    with pytest.raises(SystemExit):
        fit_json(
            ["--model", "llama2-70b", "--batch_size", "2", "--seq_len", "2048", "--fit", "12"],
            1,
            capsys,
            monkeypatch,
        )
    out, err = capsys.readouterr()
    assert "its host memory is not available" in out and "GiB of host memory for 1 rank(s)" in err


def test_fit_needs_a_number_on_a_cpu(capsys):
    """--fit without a number asks the GPU for its free memory: on a CPU it is one error line."""
    with pytest.raises(SystemExit) as exc:
        qf.main(BASE + ["--batch_size", "2", "--fit"])
    assert (
        exc.value.code == 2
        and "--fit: on a CPU give the memory to fit in" in capsys.readouterr().err
    )


@pytest.mark.parametrize("dora", [[], ["--dora"]], ids=["lora", "dora"])
def test_fit_runs_the_plan_it_prints(capsys, dora):
    """A --fit run on the tiny model trains with the plan it chose, and its losses are those of the
    same run with the plan's flags given by hand (bitwise), and of the run it replaces (the same
    rows: any split of the batch); with LoRA and with DoRA."""
    argv = BASE + dora + ["--batch_size", "4", "--steps", "2"]
    args = qf.parse_args(argv)
    plans = qf.fit_plans(qf.Plan.of(args, 1))
    peaks = [qf.estimate_memory(qf.CONFIGS[args.model], p).gpu_peak for p in plans]
    assert peaks[1] < peaks[0]  # micro-batch 2 x 2 without checkpointing: the second plan
    budget = peaks[1] / qf.GiB * (1 + 1e-9)
    fitted = train_run(argv + ["--fit", repr(budget)])
    assert "--fit chose micro-batch 2 x 2:" in capsys.readouterr().out
    assert all(fitted["summary"][k] == getattr(plans[1], k) for k in qf.FIT_FLAGS)
    by_hand = train_run(
        argv[:-4] + ["--steps", "2", "--batch_size", "2", "--grad_accum", "2", "--no-checkpointing"]
    )
    assert fitted["losses"] == by_hand["losses"]
    plain = train_run(argv)["losses"]
    torch.testing.assert_close(
        torch.tensor(fitted["losses"]), torch.tensor(plain), rtol=1e-5, atol=0
    )


TILES = ["--tile_tokens", "8"]


def recompiles_of(functions):
    """How many times torch.compile compiled these functions again (a guard failed)."""
    utils = sys.modules.get("torch._dynamo.utils")
    failures = utils.guard_failures if utils else {}
    return sum(len(failures.get(fn.__code__, ())) for fn in functions)


def tiles_and_plain(flags, folder, checkpoint):
    """(how often the parts compiled again, the run with tiles, the run without) of flags."""
    flags = [packed_file(folder) if f == "packed" else f for f in flags]
    if "--pack" in flags:
        flags += ["--eos_id", str(EOS)]
    argv = BASE + ["--batch_size", "2", "--checkpoint", checkpoint] + flags
    parts = [qf._pre, qf._core, qf._post]
    before = recompiles_of(parts)
    tiled = train_run(argv + TILES)
    recompiles = recompiles_of(parts) - before
    return recompiles, tiled, run_single([a for a in argv if a != "--compile"])


@beside("test_tiles_equal_the_run_without_them")
def tiles_compiled(folder):
    return tiles_and_plain(["--compile"], pathlib.Path(folder), tiny_qwen2(folder))


@pytest.mark.parametrize(
    "flags",
    [[], ["--dora"], ["--pack", "--data", "packed"], ["--compile"]],
    ids=["lora", "dora", "packed", "compiled"],
)
def test_tiles_equal_the_run_without_them(flags, qwen2_dir, tmp_path, beside_result):
    """--tile_tokens: a block's norms, projections and MLP in tiles of 8 tokens (attention's core
    over the whole row) give the loss at every step and the adapters after it (eps 1: the
    gradients) of the run without tiles, to fp32 rounding: a Qwen2 checkpoint (grouped-query
    attention, biases), with LoRA and DoRA, packed rows, and compiled parts (against eager
    blocks; one graph a part, whatever the number of tiles and blocks)."""
    if "--compile" in flags:
        recompiles, tiled, plain = beside_result(tiles_compiled)
    else:
        recompiles, tiled, plain = tiles_and_plain(flags, tmp_path, qwen2_dir)
    # Compiled: each part once without grad (the forward) and once with (a tile's backward),
    # not again for each tile or block.
    assert recompiles <= 3
    assert_same_run(tiled, plain)


@beside("test_estimate_counts_the_tiles")
def tiles_memory(folder):
    qf.CONFIGS["mem"] = MEM
    qf.COMPILE = False
    argv = MEM_ARGV + ["--dtype", mem_dtype(), "--no-compile", "--tile_tokens", "64"]
    return _step_memory(qf.parse_args(argv))


def test_estimate_counts_the_tiles(mem_runs, beside_result):
    """With --tile_tokens 64 the estimate's activation and all-gather rows are within 10% of the
    allocator's peak in a step (eager blocks, checkpointing, beside the tests), which is under the
    untiled step's."""
    measured, predicted = beside_result(tiles_memory)
    assert abs(predicted - measured) <= 0.1 * measured, (predicted / 2**20, measured / 2**20)
    assert measured < 0.8 * mem_runs["memory", False, True][0]


def test_fit_tiles_only_when_nothing_else_fits(monkeypatch):
    """--fit's plans try tiles last; Llama-3-8B on one 24 GB GPU gets tiles at 131,072 tokens (no
    other setting fits), and none at 8,192 (another does); --tile_tokens that does not divide a
    rank's piece of a row is one error."""
    monkeypatch.setattr(qf, "host_available", lambda: None)
    argv = ["--model", "llama3-8b", "--batch_size", "1", "--estimate", "--fit", "21.6"]
    plans = qf.fit_plans(qf.Plan.of(qf.parse_args(argv + ["--seq_len", "131072"]), 1))
    tiled = [i for i, p in enumerate(plans) if p.tile_tokens]
    assert tiled and tiled[0] > max(i for i, p in enumerate(plans) if not p.tile_tokens)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert qf.estimate(qf.parse_args(argv + ["--seq_len", "131072"]))["tile_tokens"] > 0
    assert qf.estimate(qf.parse_args(argv + ["--seq_len", "8192"]))["tile_tokens"] == 0
    with pytest.raises(qf.UserError, match="--tile_tokens 48: does not divide a rank's 64"):
        qf.check_tiles(qf.Plan(seq_len=128, context_parallel=2, tile_tokens=48))


# ---- 14. Hugging Face files ----------------------------------------------------------------------


def write_st(path, tensors, header_patch=None):
    """An independent safetensors writer (length, JSON header, raw bytes) for the reader to face."""
    names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.int16: "I16"}
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        # a 0-d tensor as 1 element
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": names[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    if header_patch:
        header_patch(header)
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob + b"".join(blobs))


def hf_state_dict(config, dtype=torch.bfloat16, seed=0):
    """Dense random weights under Hugging Face's LlamaForCausalLM names (a bias's: 1/sqrt of its
    length)."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {
            n: tuple(p.shape)
            for n, p in qf.CausalLM(config).named_parameters()
            if not p.requires_grad
        }
    return {
        n: (
            torch.ones(s) + 0.1 * torch.randn(s, generator=g)
            if "norm" in n
            else torch.randn(s, generator=g) * (1.0 if "embed" in n else s[-1] ** -0.5)
        ).to(dtype)
        for n, s in shapes.items()
    }


def write_hf_checkpoint(path, config, sd, shards=1):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(qf.config_to_hf(config, torch.bfloat16), f)
    if shards == 1:
        write_st(os.path.join(path, "model.safetensors"), sd)
        return
    names, weight_map = list(sd), {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_st(os.path.join(path, fname), {n: sd[n] for n in part})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "tiny-llama")
    config = qf.CONFIGS["tiny"]
    sd = hf_state_dict(config)
    write_hf_checkpoint(path, config, sd)
    return path, sd


@pytest.mark.parametrize("shards", [1, 3])
def test_from_pretrained_equals_quantized_originals(shards, tmp_path, hf_dir):
    """A Hugging Face directory (one file or sharded with an index) loads through from_pretrained:
    every NF4 weight dequantizes to exactly the quantized original, dense weights are the
    originals, and the logits equal a model given the same state dict through load_state_dict."""
    _, sd = hf_dir
    path = str(tmp_path / "ckpt")
    write_hf_checkpoint(path, qf.CONFIGS["tiny"], sd, shards=shards)
    model = qf.Llama.from_pretrained(path, dtype=torch.float32)
    params = dict(model.named_parameters())
    for name, w in sd.items():
        p = params[name]
        if isinstance(p, qf.NF4Tensor):
            assert torch.equal(
                p.dequantize(torch.float32), qf.to_nf4(w.float()).dequantize(torch.float32)
            ), name
        else:
            assert torch.equal(p, w.float()), name
    ref = make_model()
    missing, unexpected = ref.load_state_dict(sd, strict=False)  # dense in, quantized on the way
    assert not unexpected and all(k.endswith(("lora_A", "lora_B")) for k in missing)
    tokens = torch.randint(256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(tokens), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            model(tokens), reference_logits(ref, tokens), rtol=1e-4, atol=1e-4
        )


def test_tied_embeddings_and_rope_constants_load(tmp_path):
    """A checkpoint with tie_word_embeddings and no lm_head.weight loads its embedding as the head
    (dense, as the embedding; with nf4_head quantized like any NF4 weight), and the RoPE
    constants old checkpoints store (rotary_emb.inv_freq) are skipped, not refused."""
    config = dataclasses.replace(qf.as_family(qf.CONFIGS["tiny"]), tie_word_embeddings=True)
    sd = hf_state_dict(config)
    del sd["lm_head.weight"]
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16, dtype=torch.bfloat16)
    path = str(tmp_path / "tied")
    write_hf_checkpoint(path, config, sd)
    model = qf.Llama.from_pretrained(path, dtype=torch.float32)
    embed = sd["model.embed_tokens.weight"].float()
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert torch.equal(model.lm_head.weight, embed)
    nf4 = qf.Llama.from_pretrained(path, dtype=torch.float32, nf4_head=True)
    assert torch.equal(
        nf4.lm_head.weight.dequantize(torch.float32), qf.to_nf4(embed).dequantize(torch.float32)
    )


def test_config_llama3_and_transformers5_layout():
    """config.json from transformers 4 (rope_theta, rope_scaling) and 5 (rope_parameters) give the
    same LlamaConfig and frequencies; Llama 3.1 scaling equals Meta's apply_scaling, written out
    here: low frequencies divided by `factor`, high ones kept, a smooth band between."""
    rs = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    base = dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    )
    v4 = qf.config_from_hf({**base, "rope_theta": 500000.0, "rope_scaling": rs})
    v5 = qf.config_from_hf({**base, "rope_parameters": {**rs, "rope_theta": 500000.0}})
    assert v4.rope_theta == v5.rope_theta == 500000.0 and v4.num_key_value_heads == 8
    assert v5.rope_scaling["factor"] == 8.0
    plain = qf.config_from_hf({**base, "rope_theta": 500000.0}).rope_inv_freq()
    scaled = v5.rope_inv_freq()
    assert torch.equal(v4.rope_inv_freq(), scaled)
    assert torch.equal(scaled[0], plain[0])  # highest frequency untouched
    torch.testing.assert_close(scaled[-1], plain[-1] / 8)  # lowest divided by the factor
    meta, band = [], 0  # Meta's llama3 model.py, apply_scaling, one frequency at a time in float64
    for i in range(0, 128, 2):
        freq = 1.0 / 500000.0 ** (i / 128)
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4:
            meta.append(freq)
        elif wavelen > 8192 / 1:
            meta.append(freq / 8)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            meta.append((1 - smooth) * freq / 8 + smooth * freq)
            band += 1
    assert band > 0
    torch.testing.assert_close(scaled, torch.tensor(meta, dtype=torch.float32), rtol=1e-6, atol=0)
    # Older transformers name the type "type"; the three other keys have Meta's defaults (1, 4,
    # 8192).
    older = qf.config_from_hf(
        {**base, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0}}
    )
    assert torch.equal(older.rope_inv_freq(), scaled)


def train_run(argv):
    summary, losses, fsdp = qf.fine_tune(qf.parse_args(argv))
    return dict(
        summary=summary,
        losses=losses,
        adapters=fsdp.full_adapters(),
        local_bytes=fsdp.local_bytes(),
    )


@pytest.mark.parametrize("dora", [[], ["--dora"]], ids=["lora", "dora"])
def test_peft_adapter_files(tmp_path, dora):
    """--out writes adapter_model.safetensors with PEFT's keys
    (base_model.model.<module>.lora_A.weight, A rank x in, B out x rank; with --dora also
    base_model.model.<module>.lora_magnitude_vector, out) and adapter_config.json (use_dora);
    they load back exactly."""
    out = str(tmp_path / "out")
    argv = BASE + ["--steps", "2", "--batch_size", "2", "--out", out, "--lora_rank", "4"]
    run = train_run(argv + dora)
    with open(os.path.join(out, "adapter_model.safetensors"), "rb") as f:  # read the header by hand
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    keys = {k for k in header if k != "__metadata__"}
    assert len(keys) == (3 if dora else 2) * 7 * 4
    magnitude = header.get("base_model.model.model.layers.1.mlp.gate_proj.lora_magnitude_vector")
    assert (magnitude and magnitude["shape"]) == ([384] if dora else None)
    assert header["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]["shape"] == [
        4,
        128,
    ]
    assert header["base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"]["shape"] == [
        128,
        4,
    ]
    assert header["base_model.model.model.layers.2.self_attn.k_proj.lora_B.weight"]["shape"] == [
        64,
        4,
    ]
    with open(os.path.join(out, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 16.0
    assert set(cfg["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert cfg["task_type"] == "CAUSAL_LM" and cfg["bias"] == "none"
    assert cfg["use_dora"] is bool(dora)
    loaded = qf.load_adapters(out)
    assert loaded.keys() == run["adapters"].keys()
    for k, v in run["adapters"].items():
        assert torch.equal(loaded[k], v), k


@pytest.mark.parametrize("dropout, dora", [("0", []), ("0.2", []), ("0.2", ["--dora"])])
def test_resume_equals_uninterrupted(tmp_path, dropout, dora):
    """Stopped after step 3 and resumed with --resume, a run ends with bitwise the same adapters
    (and losses) as an uninterrupted one (CPU, fp32, same world size), with LoRA dropout too, and
    with DoRA (its magnitudes too); only the newest checkpoint stays in --out."""
    argv = (
        dora
        + BASE
        + [
            "--steps",
            "6",
            "--batch_size",
            "2",
            "--lr",
            "0.5",
            "--adam_eps",
            "1e-8",
            "--lora_dropout",
            dropout,
        ]
    )
    full = train_run(argv)
    out = str(tmp_path / "run")
    first = train_run(argv + ["--out", out, "--save_every", "3", "--stop_at", "3"])
    assert open(os.path.join(out, "latest")).read() == "checkpoint-3"
    rest = train_run(argv + ["--out", out, "--resume"])
    # only the newest kept
    assert [d for d in os.listdir(out) if d.startswith("checkpoint-")] == ["checkpoint-6"]
    assert first["losses"] + rest["losses"] == full["losses"]
    magnitudes = [k for k in full["adapters"] if k.endswith("lora_magnitude_vector")]
    assert len(magnitudes) == (7 * 4 if dora else 0)
    for k, v in full["adapters"].items():
        assert torch.equal(rest["adapters"][k], v), k


# (world, global batch, flags for both runs, flags for the sharded run only)
DORA_WORLDS = {
    "2 ranks, accumulated, offloaded": (2, 4, ["--grad_accum", "2"], ["--cpu_offload"]),
    "3 ranks, padded": (3, 6, [], []),
    "2 x 2 hybrid": (4, 4, [], ["--shard_size", "2"]),
    "2 ranks, packed": (2, 4, ["--pack", "--eos_id", "255", "--data", "packed"], []),
}


@pytest.mark.parametrize("case", list(DORA_WORLDS))
def test_dora_sharded_equals_single_process(case, tmp_path):
    """--dora trains alike at any world size: 2 ranks with --grad_accum and --cpu_offload, 3
    (shards padded), 2 x 2 hybrid (--shard_size), 2 packed, each equal to one process on the same
    global batch (fp32): losses, adapters and magnitudes, which start at W's row norms (the first
    loss is LoRA's: both start as the base) and move."""
    world, batch, both, sharded = DORA_WORLDS[case]
    both = [packed_file(tmp_path) if a == "packed" else a for a in both]
    lora = run_single(BASE + both + ["--batch_size", str(batch), "--steps", "1"])
    argv = BASE + ["--dora"] + both
    single = run_single(argv + ["--batch_size", str(batch)])
    assert single["losses"][0] == pytest.approx(lora["losses"][0], rel=1e-6)
    _, fsdp = build(qf.parse_args(argv), qf.CONFIGS["tiny"])
    start = fsdp.full_adapters()
    argv += sharded + ["--batch_size", str(batch // world)]
    for r in run_sharded(world, argv, tmp_path):
        assert_same_run(r, single)
    magnitudes = [k for k in start if k.endswith("lora_magnitude_vector")]
    assert len(magnitudes) == 7 * 4
    for k in magnitudes:
        assert (single["adapters"][k] - start[k]).abs().max() > 1e-3, k


def test_resume_at_another_world_size(tmp_path):
    """A checkpoint saved by one process resumes under 2 ranks (same global batch) and ends where
    the uninterrupted single-process run ends."""
    argv = BASE + ["--steps", "6"]
    full = run_single(argv + ["--batch_size", "4"])
    out = str(tmp_path / "run")
    train_run(argv + ["--batch_size", "4", "--out", out, "--save_every", "3", "--stop_at", "3"])
    results = run_sharded(2, argv + ["--batch_size", "2", "--out", out, "--resume"], tmp_path)
    for r in results:
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(full["losses"][3:]), rtol=1e-5, atol=1e-5
        )
        for k, v in full["adapters"].items():
            torch.testing.assert_close(r["adapters"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_sharded_save_resumes_in_one_process_and_merges_alike(tmp_path):
    """The checkpoint and merged model 2 ranks write equal one process's: the checkpoint resumes
    in one process and ends where the uninterrupted run ends, and the merged weights equal those
    the single-process run merges."""
    argv = BASE + ["--steps", "4"]
    full = run_single(argv + ["--batch_size", "4"])
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    stop = ["--stop_at", "2", "--out"]
    train_run(argv + ["--batch_size", "4"] + stop + [one, "--merge_to", one + "-merged"])
    run_sharded(
        2, argv + ["--batch_size", "2"] + stop + [two, "--merge_to", two + "-merged"], tmp_path
    )
    merged = [
        qf.SafetensorsFile(os.path.join(d + "-merged", "model.safetensors")) for d in (one, two)
    ]
    assert merged[0].entries.keys() == merged[1].entries.keys()
    for name in merged[0].entries:
        torch.testing.assert_close(
            merged[1].get(name), merged[0].get(name), rtol=1e-5, atol=1e-6, msg=name
        )
    resumed = train_run(argv + ["--batch_size", "4", "--out", two, "--resume"])
    assert_same_run(resumed, dict(losses=full["losses"][2:], adapters=full["adapters"]))


def _traffic_worker(rank, world, port, argv, out_path):
    """_worker, with each collective's group and bytes recorded: [(kind, ranks, bytes)]."""
    calls = []
    dist = torch.distributed

    def ranks(group):
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))

    real_collective = qf._collective
    real_all_reduce = dist.all_reduce

    def collective(out, inp, group, reduce_scatter=False):
        calls.append(("reduce_scatter" if reduce_scatter else "all_gather", ranks(group), inp))
        return real_collective(out, inp, group, reduce_scatter)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(("all_reduce", ranks(group), tensor.nbytes))
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    qf._collective = collective
    dist.all_reduce = all_reduce
    _worker(rank, world, port, argv, out_path)
    calls = [(kind, r, x.nbytes if torch.is_tensor(x) else x) for kind, r, x in calls]
    torch.save(calls, f"{out_path}.traffic.{rank}")


HSDP = BASE + ["--steps", "4", "--batch_size", "1", "--seq_len", "32"]


@pytest.mark.parametrize("shape", [(2, 2), (2, 3), (3, 2)], ids=["2x2", "2x3", "3x2"])
def test_hybrid_sharding_equals_one_process_and_only_gradients_cross(shape, tmp_path):
    """--shard_size S at world R x S (groups of S consecutive ranks shard, R groups replicate):
    the losses and adapters of one process with the same global batch; at 2 x 2 those of full
    sharding too. All-gathers and reduce-scatters stay within a rank's group; all that crosses
    between groups is the all-reduce of its fp32 adapter-gradient pieces (once per unit per
    backward), besides the step's few scalars (the loss, the count of targets). (Eager blocks:
    HSDP lives in the unit's hooks, which stay eager under compiled blocks.)"""
    replicas, shard = shape
    world = replicas * shard
    argv = HSDP + ["--shard_size", str(shard)]
    single = run_single(BASE + ["--steps", "4", "--batch_size", str(world), "--seq_len", "32"])
    out = str(tmp_path / "hsdp")
    spawn(_traffic_worker, (world, free_port(), argv, out), world)
    for rank in range(world):
        assert_same_run(torch.load(f"{out}.{rank}"), single)
        group = set(range(rank // shard * shard, rank // shard * shard + shard))
        across = []
        for kind, ranks, nbytes in torch.load(f"{out}.traffic.{rank}"):
            if kind != "all_reduce" or set(ranks) == group:  # clipping's norm: a scalar
                assert set(ranks) == group, (kind, ranks)
            elif len(ranks) < world:  # the replicas of this rank's pieces
                assert set(ranks) == {r for r in range(world) if r % shard == rank % shard}
                across.append(nbytes)
            else:
                assert nbytes <= 16, (kind, nbytes)  # a scalar of the step
        masters = torch.load(f"{out}.{rank}")["local_master_bytes"]
        assert across == masters * 4, (across, masters)  # 4 steps, each unit once
    if shape == (2, 2):
        full = run_sharded(world, HSDP, tmp_path)
        assert_same_run(torch.load(f"{out}.0"), full[0])


def test_a_hybrid_checkpoint_resumes_in_one_process_and_full_sharded(tmp_path):
    """A checkpoint saved at 2 x 2 (hybrid) resumes in one process and at 4 ranks sharding in
    one group, each ending where the uninterrupted run ends; its merged model equals the one a
    single process merges."""
    argv = BASE + ["--steps", "4", "--seq_len", "32"]
    full = run_single(argv + ["--batch_size", "4"])
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    stop = ["--stop_at", "2", "--out"]
    train_run(argv + ["--batch_size", "4"] + stop + [one, "--merge_to", one + "-merged"])
    hybrid = argv + ["--batch_size", "1", "--shard_size", "2"]
    run_sharded(4, hybrid + stop + [two, "--merge_to", two + "-merged"], tmp_path)
    merged = [
        qf.SafetensorsFile(os.path.join(d + "-merged", "model.safetensors")) for d in (one, two)
    ]
    for name in merged[0].entries:
        torch.testing.assert_close(merged[1].get(name), merged[0].get(name), rtol=1e-5, atol=1e-6)
    shutil.copytree(two, two + "-copy")
    resumed = train_run(argv + ["--batch_size", "4", "--out", two, "--resume"])
    assert_same_run(resumed, dict(losses=full["losses"][2:], adapters=full["adapters"]))
    copy = ["--batch_size", "1", "--out", two + "-copy", "--resume"]
    for r in run_sharded(4, argv + copy, tmp_path):
        assert_same_run(r, dict(losses=full["losses"][2:], adapters=full["adapters"]))


def test_shard_size_is_checked_and_a_group_across_machines_is_warned(monkeypatch, capsys):
    """A --shard_size that does not divide the world is one error line before anything is built;
    by default a run over several machines shards within each (torchrun's LOCAL_WORLD_SIZE);
    groups that span machines are a warning, not a refusal."""
    with pytest.raises(qf.UserError, match="--shard_size 3: does not divide the 4 ranks"):
        qf.shard_size(3, 4, 4)
    assert qf.shard_size(0, 16, 8) == 8 and qf.shard_size(0, 8, 8) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = qf.parse_args(["--model", "llama2-70b", "--shard_size", "16"])
    config = qf.as_family(qf.CONFIGS["llama2-70b"])
    # A run's set-up at world 16, up to its plan (nothing is built).
    run = types.SimpleNamespace(args=args, world=16, config=config, device=torch.device("cpu"))
    plan = qf.Run._plan(run)
    assert "groups that span machines of 8 ranks" in capsys.readouterr().out and plan.shard == 16


def test_the_estimates_title_names_the_ranks_that_shard_the_state(monkeypatch, capsys):
    """--estimate's table names what divides its rows: the ranks that shard the state (2 for
    --shard_size 2 in a world of 4; it used to call them the world)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    qf.estimate(qf.parse_args(["--model", "llama2-7b", "--shard_size", "2", "--estimate"]))
    out = capsys.readouterr().out
    assert "the state sharded over 2 ranks:" in out and "world 2" not in out


def test_estimate_hybrid_70b_on_two_machines(monkeypatch):
    """Llama-2-70B on 2 machines of 8 GPUs: full sharding over 16 against 2 x 8 hybrid. By
    default the groups are a machine's 8 ranks, and the hybrid's per-GPU peak is above the full
    shard's (its state is sharded over 8, not 16)."""
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    argv = ["--model", "llama2-70b", "--batch_size", "2", "--seq_len", "2048", "--estimate"]
    full = qf.estimate(qf.parse_args(argv + ["--shard_size", "16"]))
    hybrid = qf.estimate(qf.parse_args(argv))
    assert full["shard_size"] == 16 and hybrid["shard_size"] == 8
    assert hybrid["predicted_peak_gib"] > full["predicted_peak_gib"]


@pytest.mark.parametrize("dies", ["writing the adapters", "renaming latest"])
def test_interrupted_save_keeps_previous_checkpoint(dies, tmp_path, monkeypatch):
    """A save of step 4 that dies half-way -- writing its adapters (half a file), or at the very
    end, as `latest` is renamed into place -- leaves `latest` naming the checkpoint of step 2, and
    resuming from it ends bitwise where the uninterrupted run ends."""
    out = str(tmp_path / "run")
    argv = BASE + ["--steps", "4", "--batch_size", "2"]
    full = train_run(argv)
    real_save, real_replace = qf.save_safetensors, os.replace

    def dying_save(path, *a, **k):
        if ".checkpoint-4.tmp" in path:
            with open(path + ".tmp", "wb") as f:
                f.write(b"\x00" * 100)
            raise KeyboardInterrupt("killed")
        return real_save(path, *a, **k)

    def dying_replace(src, dst):
        if os.path.basename(dst) == "latest" and open(src).read() == "checkpoint-4":
            raise KeyboardInterrupt("killed")
        return real_replace(src, dst)

    if dies == "writing the adapters":
        monkeypatch.setattr(qf, "save_safetensors", dying_save)
    else:
        monkeypatch.setattr(qf.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        qf.fine_tune(qf.parse_args(argv + ["--out", out, "--save_every", "2"]))
    monkeypatch.setattr(qf, "save_safetensors", real_save)
    monkeypatch.setattr(qf.os, "replace", real_replace)
    assert open(os.path.join(out, "latest")).read() == "checkpoint-2"
    if dies == "writing the adapters":
        assert not os.path.exists(os.path.join(out, "checkpoint-4"))
    resumed = train_run(argv + ["--out", out, "--resume"])
    assert resumed["losses"] == full["losses"][2:]
    for k, v in full["adapters"].items():
        assert torch.equal(resumed["adapters"][k], v), k


@pytest.mark.parametrize("dora", [[], ["--dora"]], ids=["lora", "dora"])
def test_merge_to_writes_merged_hf_checkpoint(tmp_path, hf_dir, dora):
    """--merge_to writes config.json + model.safetensors in which every projection is
    W' = W + (alpha/r) B A (W the NF4 base, B and A the adapters --out wrote; with --dora,
    (m / n)[:, None] W', n the row norms of W', m the magnitude) and every other weight is the
    checkpoint's own; from_pretrained reads it back. The config keeps the source's other keys
    (its token ids), and its generation_config.json comes along."""
    path, sd = str(tmp_path / "base"), hf_dir[1]
    shutil.copytree(hf_dir[0], path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = {**json.load(f), "bos_token_id": 1, "eos_token_id": [2, 3]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 3]}, f)
    out, merged = str(tmp_path / "out"), str(tmp_path / "merged")
    train_run(
        BASE
        + [
            "--steps",
            "2",
            "--batch_size",
            "2",
            "--checkpoint",
            path,
            "--out",
            out,
            "--merge_to",
            merged,
        ]
        + dora
    )
    adapters = qf.load_adapters(out)
    sf = qf.SafetensorsFile(os.path.join(merged, "model.safetensors"))
    assert sf.entries.keys() == sd.keys()
    for name, w in sd.items():
        module = name[: -len(".weight")]
        nf4 = w.dim() == 2 and "embed" not in name and "lm_head" not in name
        expected = qf.to_nf4(w.float()).dequantize(torch.float32) if nf4 else w.float()
        if module + ".lora_A" in adapters:
            # trained: the merge changes the weight
            assert adapters[module + ".lora_B"].abs().max() > 0
            expected = expected + 2.0 * (
                adapters[module + ".lora_B"] @ adapters[module + ".lora_A"]
            )
            if dora:
                m = adapters[module + ".lora_magnitude_vector"]
                expected = (m / expected.norm(dim=1))[:, None] * expected
        torch.testing.assert_close(sf.get(name), expected, rtol=1e-6, atol=1e-6, msg=name)
    reloaded = qf.Llama.from_pretrained(merged, dtype=torch.float32)
    assert isinstance(reloaded.model.layers[0].mlp.up_proj.weight, qf.NF4Tensor)
    with open(os.path.join(merged, "config.json")) as f:
        merged_cfg = json.load(f)
    assert merged_cfg["bos_token_id"] == 1 and merged_cfg["eos_token_id"] == [2, 3]
    assert (
        merged_cfg["hidden_size"] == cfg["hidden_size"]
        and merged_cfg["tie_word_embeddings"] is False
    )
    assert os.path.isfile(os.path.join(merged, "generation_config.json"))


def test_sharded_export_round_trips_bit_for_bit(tmp_path):
    """--merge_to above --max_shard_size writes Hugging Face's sharded layout:
    model-0000k-of-0000n.safetensors, each at most the limit unless one tensor is larger, and
    model.safetensors.index.json listing every tensor once (total_size its bytes); our loader reads
    it to the same tensors, bit for bit, as the single-file export."""
    argv = BASE + ["--steps", "2", "--batch_size", "2", "--dtype", "bf16"]
    one, sharded = str(tmp_path / "one"), str(tmp_path / "sharded")
    train_run(argv + ["--merge_to", one])
    # 200 kB; the embeddings are 65.5 kB
    train_run(argv + ["--merge_to", sharded, "--max_shard_size", "0.0002"])
    assert sorted(os.listdir(one)) == ["config.json", "model.safetensors"]
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(os.listdir(sharded)) == sorted(
        files + ["config.json", "model.safetensors.index.json"]
    )
    whole = qf.SafetensorsFile(os.path.join(one, "model.safetensors"))
    assert sorted(index["weight_map"]) == sorted(whole.entries)  # every tensor, once
    for f in files:
        sf = qf.SafetensorsFile(os.path.join(sharded, f))
        sizes = [end - begin for _, _, begin, end in sf.entries.values()]
        assert sum(sizes) <= 200_000 or len(sizes) == 1
        assert all(index["weight_map"][name] == f for name in sf.entries)
    assert index["metadata"]["total_size"] == sum(e - b for _, _, b, e in whole.entries.values())
    config = qf.config_from_hf(json.load(open(os.path.join(sharded, "config.json"))))
    sources = qf.load_checkpoint(sharded, config)
    loaded = {name: sf.get(key) for name, (sf, key) in sources.items()}
    assert loaded.keys() == whole.entries.keys()
    for name, t in loaded.items():
        assert torch.equal(t, whole.get(name)), name


def test_loading_and_drawing_report_progress(tmp_path, hf_dir, monkeypatch, capsys):
    """Loading a checkpoint and drawing a random base print, on rank 0, a line at least every
    PROGRESS_S seconds (here 0: after every tensor) with the tensors done of all, the bytes read of
    all, the rate and the time left, and one line when done."""
    monkeypatch.setattr(qf, "PROGRESS_S", 0.0)
    for argv, what in (
        (["--checkpoint", hf_dir[0]], f"loading {hf_dir[0]}"),
        ([], "drawing a random base"),
    ):
        capsys.readouterr()
        train_run(BASE + ["--steps", "1", "--batch_size", "2"] + argv)
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(what)]
        assert len(lines) == 40 and re.fullmatch(
            rf"{re.escape(what)}: 39 tensors, [\d.]+ [kM]B in [\d.]+ s \(.+/s\)", lines[-1]
        ), lines[-1]
        # The first line has no rate yet; the second does.
        assert re.fullmatch(
            rf"{re.escape(what)}: 1/39 tensors, [\d.]+ [kM]?B of [\d.]+ MB", lines[0]
        )
        assert re.fullmatch(
            rf"{re.escape(what)}: 2/39 tensors, [\d.]+ [kM]?B of [\d.]+ MB, .+/s, \d+ s left",
            lines[1],
        )


def test_the_first_progress_line_says_the_kernels_compile(monkeypatch, capsys):
    """With the NF4 kernels compiled, the first line, whose time holds their compiles, says so
    and gives no rate; the lines after give theirs."""
    monkeypatch.setattr(qf, "PROGRESS_S", 0.0)
    items = [(f"w{i}", torch.zeros(64)) for i in range(3)]
    for compile in (True, False):
        list(qf.progress(items, "drawing", 3, 768, compile))
        first, second = capsys.readouterr().out.splitlines()[:2]
        assert first.endswith(", compiling the NF4 kernels") == compile and "/s" not in first
        assert "/s" in second and "compiling" not in second


def test_time_left_is_honest_after_slow_first_tensors(monkeypatch, capsys):
    """Progress after three slow tensors (1 s each, as when the first ones wait for the kernels'
    compiles) and 200 fast ones (0.05 s each), on a clock of the test's own, predicts the time
    left within 10% of what it turns out to be: each rate is measured since the line before, never
    over the first line's time (a rate from the end of the first tensor says 1.7x too much)."""
    clock = [0.0]
    monkeypatch.setattr(qf, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(qf, "PROGRESS_S", 2.5)

    def slow_first():
        for i in range(203):
            clock[0] += 1.0 if i < 3 else 0.05
            yield f"w{i}", torch.zeros(1000)

    seen = [clock[0] for _ in qf.progress(slow_first(), "loading", 203, 203 * 4000)]
    lines = capsys.readouterr().out.splitlines()
    said = [
        (int(m[1]), float(m[2]))
        for m in map(re.compile(r".* (\d+)/203 .* (\d+) s left").match, lines)
        if m
    ]
    assert len(said) >= 3 and lines[0] == "loading: 3/203 tensors, 12.00 kB of 812.00 kB"
    for n, left in said:
        real = seen[-1] - seen[n - 1]
        assert abs(left - real) <= 0.1 * real + 0.5, (n, left, real)


def _bad(tmp_path, hf_dir, case):
    """Builds the bad input for `case`; returns (argv, expected words in the error)."""
    path, sd = hf_dir
    d = str(tmp_path / "bad")
    cfg = qf.config_to_hf(qf.CONFIGS["tiny"], torch.bfloat16)

    def ckpt(sd=sd, cfg=cfg, patch=None):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        write_st(os.path.join(d, "model.safetensors"), sd, patch)
        return ["--checkpoint", d]

    if case == "missing dir":
        return ["--checkpoint", d], "no such directory"
    if case == "llama3 rope without factor":
        return ckpt(
            cfg={**cfg, "rope_scaling": {"rope_type": "llama3"}}
        ), "llama3 rope_scaling needs a positive factor"
    if case == "head dim":  # an explicit head_dim (Mistral, Qwen3) makes q_proj another shape
        return ckpt(cfg={**cfg, "head_dim": 64}), "q_proj.weight has shape [128, 128], config.json"
    if case == "odd head dim":
        return ckpt(cfg={**cfg, "head_dim": 33}), "head_dim must be even"
    if case == "qwen sliding window":
        qwen = {**cfg, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64}
        return ckpt(cfg=qwen), "use_sliding_window True: sliding-window attention is not followed"
    if case == "mistral window shorter":
        return ckpt(cfg={**cfg, "model_type": "mistral", "sliding_window": 16}), (
            "--seq_len 32: 32 tokens exceed the model's sliding_window of 16"
        )
    if case == "sample past the sliding window":  # --seq_len 32 fits, the prompt and sample not
        mistral = ckpt(cfg={**cfg, "model_type": "mistral", "sliding_window": 40})
        return mistral + ["--prompt", "1,2,3", "--sample", "38"], (
            "--sample 38: --prompt and its sample: 41 tokens exceed the model's sliding_window"
        )
    if case == "gelu":
        return ckpt(cfg={**cfg, "hidden_act": "gelu"}), "hidden_act 'gelu' is not supported"
    if case == "rope yarn":
        return ckpt(
            cfg={**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
        ), "rope_scaling type 'yarn' is not supported"
    if case == "bytes for shape":
        return ckpt(
            patch=lambda h: h["model.norm.weight"].update(shape=[64])
        ), "bytes for shape [64]"
    if case == "negative offsets":
        return ckpt(
            patch=lambda h: h["model.norm.weight"].update(data_offsets=[-16, 0])
        ), "offsets [-16, 0] run past"
    if case == "infinite theta":
        return ckpt(cfg={**cfg, "rope_theta": float("inf")}), "rope_theta must be a positive number"
    if case == "kv heads as text":
        return ckpt(
            cfg={**cfg, "num_key_value_heads": "2"}
        ), "num_key_value_heads must divide num_attention_heads"
    if case == "eps as text":
        return ckpt(cfg={**cfg, "rms_norm_eps": "1e-5"}), "rms_norm_eps must be a positive number"
    if case == "kv heads":
        return ckpt(
            cfg={**cfg, "num_key_value_heads": 3}
        ), "num_key_value_heads must divide num_attention_heads"
    if case == "hidden size":
        return ckpt(
            cfg={
                **{k: v for k, v in cfg.items() if k != "head_dim"},
                "hidden_size": 4,
                "vocab_size": 10,
                "num_attention_heads": 1,
                "num_key_value_heads": 1,
            }
        ), "every weight's size must be a multiple of 64"
    if case == "index of numbers":
        args = ckpt()
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": {"lm_head.weight": 3}}, f)
        return args, "not a safetensors index (no weight_map of file names)"
    # the model used to be built first: minutes of modules, then the mismatch
    if case == "far more layers":
        return (
            ckpt(cfg={**cfg, "num_hidden_layers": 10**6}),
            "8,999,964 tensors missing from the checkpoint, "
            "e.g. model.layers.4.input_layernorm.weight",
        )
    # its shards used to be allocated first: tens of GB, the allocator's traceback
    if case == "far wider":
        return ckpt(
            cfg={
                **{k: v for k, v in cfg.items() if k != "head_dim"},
                "hidden_size": 1 << 16,
                "intermediate_size": 1 << 18,
            }
        ), "tensor model.embed_tokens.weight has shape [256, 128], config.json implies [256, 65536]"
    # a weight_map naming files outside the checkpoint
    if case in ("index climbs out", "index absolute"):
        args = ckpt()
        target = (
            "../elsewhere.safetensors"
            if case == "index climbs out"
            else os.path.join(path, "model.safetensors")
        )
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": {"lm_head.weight": target}}, f)
        return (
            args,
            f"entry lm_head.weight names {target!r}, not a file in the checkpoint directory",
        )
    if case == "boolean as text":
        return (
            ckpt(cfg={**cfg, "tie_word_embeddings": "false"}),
            "tie_word_embeddings must be true or false, not 'false'",
        )
    if case == "context length 0":
        return ckpt(
            cfg={**cfg, "max_position_embeddings": 0}
        ), "max_position_embeddings must be a positive integer"
    if case == "layers as true":
        return ckpt(
            cfg={**cfg, "num_hidden_layers": True}
        ), "num_hidden_layers is missing or not a positive integer"
    if case == "merge onto the base":
        return [
            "--checkpoint",
            path,
            "--merge_to",
            path,
        ], "holds a model already; choose a new directory"
    if case == "missing config":
        os.makedirs(d)
        return ["--checkpoint", d], "config.json: no such file"
    if case == "not a llama":
        return ckpt(
            cfg={**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
        ), "model_type 'gpt2' is not one this file follows (llama, mistral, qwen2, qwen3)"
    if case == "wrong shape":
        return ckpt(
            sd={**sd, "model.norm.weight": torch.ones(64)}
        ), "model.norm.weight has shape [64]"
    if case == "unexpected name":
        return ckpt(
            sd={**sd, "model.layers.9.mlp.up_proj.weight": torch.ones(2, 2)}
        ), "unexpected tensor"
    if case == "missing tensor":
        return ckpt(
            sd={k: v for k, v in sd.items() if k != "lm_head.weight"}
        ), "missing from the checkpoint"
    if case == "integer weight":
        return ckpt(
            sd={**sd, "model.norm.weight": torch.ones(128, dtype=torch.int16)}
        ), "is I16, not floating point"
    if case == "unknown dtype":
        return ckpt(
            patch=lambda h: h["model.norm.weight"].update(dtype="F8_E4M3")
        ), "unsupported dtype F8_E4M3"
    if case == "header beyond file":
        args = ckpt()
        with open(os.path.join(d, "model.safetensors"), "r+b") as f:
            f.write((10**9).to_bytes(8, "little"))
        return args, "runs past the end of the file"
    if case == "truncated":
        args = ckpt()
        fname = os.path.join(d, "model.safetensors")
        os.truncate(fname, os.path.getsize(fname) - 1000)
        return args, "run past the end of the data"
    if case == "overlapping":

        def overlap(h):
            h["model.norm.weight"]["data_offsets"] = list(h["lm_head.weight"]["data_offsets"])
            h["model.norm.weight"]["data_offsets"][1] = (
                h["model.norm.weight"]["data_offsets"][0] + 256
            )

        return ckpt(patch=overlap), "overlap"
    if case == "short data":
        f = tmp_path / "short.txt"
        f.write_bytes(b"hello")
        return ["--data", str(f)], "fewer than --seq_len + 1"
    if case == "token id":
        f = tmp_path / "tokens.bin"
        f.write_bytes(torch.full((500,), 300, dtype=torch.int16).numpy().tobytes())
        return ["--data", str(f)], "token id 300 >= vocab_size 256"
    if case == "bin for a big vocabulary":
        f = tmp_path / "tokens.bin"
        f.write_bytes(b"\0" * 1000)
        return ["--data", str(f), "--model", "llama3-8b"], "save the tokens as .npy (uint32)"
    if case == "other extension, as bytes":  # a .csv is bytes too: 5 of them
        f = tmp_path / "tokens.csv"
        f.write_text("1,2,3")
        return ["--data", str(f)], "tokens.csv: 5 tokens, fewer than --seq_len + 1 = 33"
    if case == "negative token id":
        np.save(tmp_path / "tokens.npy", np.full(500, -1, np.int32))
        return ["--data", str(tmp_path / "tokens.npy")], "negative token id -1"
    if case == "jsonl to a byte model":
        (tmp_path / "chats.jsonl").write_text('{"text": "hi"}\n' * 40)
        return ["--data", str(tmp_path / "chats.jsonl")], "JSON lines need --checkpoint's tokenizer"
    if case.startswith("adapter"):
        out = str(tmp_path / "out")
        train_run(BASE + ["--steps", "1", "--batch_size", "2", "--checkpoint", path, "--out", out])
        config = json.load(open(os.path.join(out, "adapter_config.json")))
        argv = ["--checkpoint", path, "--adapter", out, "--steps", "0"]
        if case == "adapter rank given otherwise":
            return argv + ["--lora_rank", "4"], "--lora_rank 4: --adapter's is 8"
        patch = {
            "adapter not LoRA": ({"peft_type": "IA3"}, "peft_type 'IA3': this file loads LORA"),
            "adapter of the head": ({"target_modules": ["lm_head"]}, "target_modules ['lm_head']"),
            "adapter of another rank": ({"r": 16}, "is not this model's ([16, "),
        }[case]
        json.dump({**config, **patch[0]}, open(os.path.join(out, "adapter_config.json"), "w"))
        return argv, patch[1]
    if case == "float tokens":
        np.save(tmp_path / "tokens.npy", np.zeros(500))
        return ["--data", str(tmp_path / "tokens.npy")], "must be a 1-D integer array"
    if case == "not an array":
        (tmp_path / "tokens.npy").write_bytes(b"\x93NUMPY garbage" * 100)
        return ["--data", str(tmp_path / "tokens.npy")], "cannot be read as .npy"
    if case == "mask counts nothing":
        np.savez(
            tmp_path / "sft.npz", tokens=np.ones(500, np.int32), loss_mask=np.zeros(500, np.uint8)
        )
        return ["--data", str(tmp_path / "sft.npz")], "loss_mask counts no target"
    if case == "mask values":
        np.savez(
            tmp_path / "sft.npz", tokens=np.ones(500, np.int32), loss_mask=np.full(500, 2, np.uint8)
        )
        return ["--data", str(tmp_path / "sft.npz")], "loss_mask holds values other than 0 and 1"
    if case == "mask length":
        np.savez(
            tmp_path / "sft.npz", tokens=np.ones(500, np.int32), loss_mask=np.ones(499, np.uint8)
        )
        return ["--data", str(tmp_path / "sft.npz")], "loss_mask has shape (499,), tokens (500,)"
    if case == "val_data missing":
        return [
            "--val_data",
            str(tmp_path / "nope.npy"),
        ], f"--val_data {tmp_path / 'nope.npy'}: no such file"
    if case == "val_data too short":
        (tmp_path / "val.txt").write_bytes(b"short")
        return [
            "--val_data",
            str(tmp_path / "val.txt"),
        ], "val.txt: 5 tokens, fewer than --seq_len + 1 = 33"
    if case == "val_data past the vocabulary":
        np.save(tmp_path / "val.npy", np.full(500, 300, np.int32))
        return ["--val_data", str(tmp_path / "val.npy")], "val.npy: token id 300 >= vocab_size 256"
    if case == "prompt not ids":
        return [
            "--model",
            "llama3-8b",
            "--sample",
            "5",
            "--prompt",
            "Hello",
        ], "comma-separated token ids"
    if case == "resume other rank":
        out = str(tmp_path / "out")
        train_run(BASE + ["--steps", "1", "--batch_size", "2", "--out", out])
        return ["--out", out, "--resume", "--lora_rank", "4"], "saved with --lora_rank 8"
    if case == "resume LoRA with --dora":
        out = str(tmp_path / "out")
        train_run(BASE + ["--steps", "1", "--batch_size", "2", "--out", out])
        return ["--out", out, "--resume", "--dora"], "saved with --dora False, this run has --dora"
    if case == "resume DoRA without --dora":
        out = str(tmp_path / "out")
        train_run(BASE + ["--steps", "1", "--batch_size", "2", "--out", out, "--dora"])
        return ["--out", out, "--resume"], "saved with --dora True, this run has --dora False"
    if case == "resume an older version's checkpoint":  # its state was a torch.save
        out = str(tmp_path / "out")
        train_run(BASE + ["--steps", "1", "--batch_size", "2", "--out", out])
        os.remove(os.path.join(out, "checkpoint-1", "training_state.safetensors"))
        torch.save({"step": 1}, os.path.join(out, "checkpoint-1", "training_state.pt"))
        return ["--out", out, "--resume"], "training_state.pt: saved by an older version"
    if case == "resume another layout":  # the moments under other names
        out = str(tmp_path / "out")
        train_run(BASE + ["--steps", "1", "--batch_size", "2", "--out", out])
        rewrite_state(out, lambda name, t: (name.replace("/", "."), t))
        return ["--out", out, "--resume"], "its adapters or AdamW moments are not this model's"
    if case == "truncated training state":
        out = str(tmp_path / "out")
        train_run(BASE + ["--steps", "1", "--batch_size", "2", "--out", out])
        path = os.path.join(out, "checkpoint-1", "training_state.safetensors")
        os.truncate(path, os.path.getsize(path) - 100)
        return ["--out", out, "--resume"], "training_state.safetensors: tensor"
    if case == "out holds a checkpoint":  # a new run there, without --resume, would replace it
        out = str(tmp_path / "out")
        train_run(BASE + ["--steps", "1", "--batch_size", "2", "--out", out])
        return [
            "--out",
            out,
        ], "holds a run's checkpoint; --resume continues it, or choose another --out"
    if case == "resume other seed":  # LoRA dropout's masks and the batches come from it
        out = str(tmp_path / "out")
        train_run(BASE + ["--steps", "1", "--batch_size", "2", "--out", out])
        return [
            "--out",
            out,
            "--resume",
            "--seed",
            "7",
        ], "saved with --seed 1337, this run has --seed 7"
    if case == "resume other shapes":
        out = str(tmp_path / "out")
        train_run(BASE + ["--steps", "1", "--batch_size", "2", "--out", out])
        rewrite_state(
            out, lambda name, t: (name, torch.zeros(3) if name.startswith("exp_avg/") else t)
        )
        return ["--out", out, "--resume"], "its adapters or AdamW moments are not this model's"
    if case == "training state not an object":
        out = str(tmp_path / "out")
        train_run(BASE + ["--steps", "1", "--batch_size", "2", "--out", out])
        rewrite_state(out, lambda name, t: (name, t), "[1, 2]")
        return ["--out", out, "--resume"], "its training_state is not a JSON object"
    if case == "save blocked":  # a directory where the checkpoint's pointer goes
        os.makedirs(tmp_path / "out" / "latest")
        return ["--out", str(tmp_path / "out")], "latest: cannot be written (Is a directory)"
    # step 1's loss is finite, its weight decay overflows: never saved
    if case == "non-finite update":
        return [
            "--lr",
            "1e38",
            "--weight_decay",
            "10",
            "--steps",
            "1",
            "--out",
            str(tmp_path / "out"),
        ], "out: the adapters hold inf or NaN after step 1, not saved"
    if case == "profile too short":
        return ["--profile", str(tmp_path / "prof")], "--profile traces steps 3-5: this run has 2"
    if case == "non-finite weight":
        return ckpt(
            sd={**sd, "model.norm.weight": torch.full((128,), float("inf"), dtype=torch.bfloat16)}
        ), f"{d}: tensor model.norm.weight holds inf or NaN"
    if case == "non-finite loss":  # step 1's update, at this learning rate, overflows the adapters
        return ["--lr", "1e38"], "loss is nan at step 2; stopped before updating"
    raise AssertionError(case)


BAD_CHECKPOINT_CASES = [  # section 9: checkpoints, their config.json, resuming, saving
    "missing dir",
    "missing config",
    "not a llama",
    "wrong shape",
    "unexpected name",
    "missing tensor",
    "integer weight",
    "unknown dtype",
    "header beyond file",
    "truncated",
    "overlapping",
    "bytes for shape",
    "negative offsets",
    "non-finite weight",
    "head dim",
    "odd head dim",
    "qwen sliding window",
    "mistral window shorter",
    "sample past the sliding window",
    "gelu",
    "rope yarn",
    "llama3 rope without factor",
    "infinite theta",
    "eps as text",
    "kv heads",
    "kv heads as text",
    "hidden size",
    "index of numbers",
    "far more layers",
    "far wider",
    "index climbs out",
    "index absolute",
    "boolean as text",
    "context length 0",
    "layers as true",
    "merge onto the base",
    "out holds a checkpoint",
    "resume other rank",
    "resume LoRA with --dora",
    "resume DoRA without --dora",
    "resume an older version's checkpoint",
    "resume another layout",
    "truncated training state",
    "resume other seed",
    "resume other shapes",
    "training state not an object",
    "save blocked",
    "non-finite update",
]


def rewrite_state(out, change, state=None):
    """out's checkpoint-1 training state written again, each (name, tensor) as change(name, tensor)
    gives it, its training_state metadata as `state` (None: as it was)."""
    path = os.path.join(out, "checkpoint-1", "training_state.safetensors")
    sf = qf.SafetensorsFile(path)
    tensors = dict(change(name, sf.get(name)) for name in sf.entries)
    specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    metadata = {"training_state": state or sf.metadata["training_state"]}
    qf.save_safetensors(path, specs, tensors.__getitem__, metadata)


def assert_one_line_error(case, tmp_path, hf_dir, capsys):
    argv, words = _bad(tmp_path, hf_dir, case)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        qf.main(BASE + ["--steps", "2", "--batch_size", "2"] + argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


@pytest.mark.parametrize("case", BAD_CHECKPOINT_CASES)
def test_bad_checkpoint_one_line_error(case, tmp_path, hf_dir, capsys):
    """Each bad checkpoint, config, resume or save exits non-zero with one line `error: ...` naming
    the file or flag and what is wrong, and no traceback."""
    assert_one_line_error(case, tmp_path, hf_dir, capsys)


@pytest.mark.parametrize("offload", [[], ["--cpu_offload"]])
def test_shards_that_do_not_fit_are_refused_before_allocating(
    offload, tmp_path, hf_dir, monkeypatch, capsys
):
    """A model whose sharded state would not fit this machine's available memory (here made 1 MB) is
    refused before anything is built, in one line with the estimate's figure and what is available.
    """
    monkeypatch.setattr(qf, "host_available", lambda: 10**6)
    monkeypatch.setattr(qf, "build", None)  # never reached
    with pytest.raises(SystemExit):
        qf.main(BASE + ["--batch_size", "2", "--checkpoint", hf_dir[0]] + offload)
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "the model's shards need 0.00" in err[0]
        and "0.00 GiB is available" in err[0]
    ), err


def test_sharded_loading_keeps_only_the_shard(tmp_path, hf_dir):
    """Loading a checkpoint under 2 ranks keeps about half the weight bytes on each rank, which
    --estimate's weight rows at world 2 predict (within 5%), and training from it equals the
    single-process run."""
    path, _ = hf_dir
    argv = BASE + ["--checkpoint", path]
    single = run_single(argv + ["--batch_size", "4"])
    results = run_sharded(2, argv + ["--batch_size", "2"], tmp_path)
    est = qf.estimate_memory(qf.CONFIGS["tiny"], qf.Plan(dtype="fp32", shard=2))
    weights = sum(v for k, v in est.state.items() if "gradients" not in k and "AdamW" not in k)
    for r in results:
        assert_same_run(r, single)
        assert r["local_bytes"] <= single["local_bytes"] / 2 + 4096
        assert abs(weights - r["local_bytes"]) < 0.05 * r["local_bytes"], (
            weights,
            r["local_bytes"],
        )


# ---- 15. your data: text, JSONL and chats, tokenized as transformers does ------------------------


# Tokenizers are trained here, in under a second, shaped like Llama 3.1's, Qwen2.5's and SmolLM2's
# tokenizer.json, with their real chat templates; nothing is downloaded. The reference is
# transformers' PreTrainedTokenizerFast over the same files (AutoTokenizer can differ: in
# transformers 5 a tokenizer_class with its own __init__, GPT2Tokenizer or Qwen2Tokenizer, rebuilds
# the pipeline with the class's pre-tokenizer). These tests skip where tokenizers or transformers
# is missing; CI installs both.

# The chat templates of Llama 3.1 Instruct, Qwen2.5 Instruct and SmolLM2 Instruct, copied from
# their public checkpoints (data, not code).
CHAT_TEMPLATES = {
    "llama3.1-instruct.jinja": (
        "{{- bos_token }}\n"
        "{%- if custom_tools is defined %}\n"
        "    {%- set tools = custom_tools %}\n"
        "{%- endif %}\n"
        "{%- if not tools_in_user_message is defined %}\n"
        "    {%- set tools_in_user_message = true %}\n"
        "{%- endif %}\n"
        "{%- if not date_string is defined %}\n"
        '    {%- set date_string = "26 Jul 2024" %}\n'
        "{%- endif %}\n"
        "{%- if not tools is defined %}\n"
        "    {%- set tools = none %}\n"
        "{%- endif %}\n"
        "\n"
        "{#- This block extracts the system message, so we can slot it into the"
        " right place. #}\n"
        "{%- if messages[0]['role'] == 'system' %}\n"
        "    {%- set system_message = messages[0]['content']|trim %}\n"
        "    {%- set messages = messages[1:] %}\n"
        "{%- else %}\n"
        '    {%- set system_message = "" %}\n'
        "{%- endif %}\n"
        "\n"
        "{#- System message + builtin tools #}\n"
        '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
        "{%- if builtin_tools is defined or tools is not none %}\n"
        '    {{- "Environment: ipython\\n" }}\n'
        "{%- endif %}\n"
        "{%- if builtin_tools is defined %}\n"
        "    {{- \"Tools: \" + builtin_tools | reject('equalto', 'code_interprete"
        'r\') | join(", ") + "\\n\\n"}}\n'
        "{%- endif %}\n"
        '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
        '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
        "{%- if tools is not none and not tools_in_user_message %}\n"
        '    {{- "You have access to the following functions. To call a functio'
        'n, please respond with JSON for a function call." }}\n'
        '    {{- \'Respond in the format {"name": function name, "parameters": d'
        "ictionary of argument name and its value}.' }}\n"
        '    {{- "Do not use variables.\\n\\n" }}\n'
        "    {%- for t in tools %}\n"
        "        {{- t | tojson(indent=4) }}\n"
        '        {{- "\\n\\n" }}\n'
        "    {%- endfor %}\n"
        "{%- endif %}\n"
        "{{- system_message }}\n"
        '{{- "<|eot_id|>" }}\n'
        "\n"
        "{#- Custom tools are passed in a user message with some extra guidance #}\n"
        "{%- if tools_in_user_message and not tools is none %}\n"
        "    {#- Extract the first user message so we can plug it in here #}\n"
        "    {%- if messages | length != 0 %}\n"
        "        {%- set first_user_message = messages[0]['content']|trim %}\n"
        "        {%- set messages = messages[1:] %}\n"
        "    {%- else %}\n"
        '        {{- raise_exception("Cannot put tools in the first user messag'
        "e when there's no first user message!\") }}\n"
        "{%- endif %}\n"
        "    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
        '    {{- "Given the following functions, please respond with a JSON for'
        ' a function call " }}\n'
        '    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}\n'
        '    {{- \'Respond in the format {"name": function name, "parameters": d'
        "ictionary of argument name and its value}.' }}\n"
        '    {{- "Do not use variables.\\n\\n" }}\n'
        "    {%- for t in tools %}\n"
        "        {{- t | tojson(indent=4) }}\n"
        '        {{- "\\n\\n" }}\n'
        "    {%- endfor %}\n"
        '    {{- first_user_message + "<|eot_id|>"}}\n'
        "{%- endif %}\n"
        "\n"
        "{%- for message in messages %}\n"
        "    {%- if not (message.role == 'ipython' or message.role == 'tool' or"
        " 'tool_calls' in message) %}\n"
        "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id"
        "|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
        "    {%- elif 'tool_calls' in message %}\n"
        "        {%- if not message.tool_calls|length == 1 %}\n"
        '            {{- raise_exception("This model only supports single tool-'
        'calls at once!") }}\n'
        "        {%- endif %}\n"
        "        {%- set tool_call = message.tool_calls[0].function %}\n"
        "        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}\n"
        "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
        '            {{- "<|python_tag|>" + tool_call.name + ".call(" }}\n'
        "            {%- for arg_name, arg_val in tool_call.arguments | items %}\n"
        "                {{- arg_name + '=\"' + arg_val + '\"' }}\n"
        "                {%- if not loop.last %}\n"
        '                    {{- ", " }}\n'
        "                {%- endif %}\n"
        "                {%- endfor %}\n"
        '            {{- ")" }}\n'
        "        {%- else  %}\n"
        "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
        "            {{- '{\"name\": \"' + tool_call.name + '\", ' }}\n"
        "            {{- '\"parameters\": ' }}\n"
        "            {{- tool_call.arguments | tojson }}\n"
        '            {{- "}" }}\n'
        "        {%- endif %}\n"
        "        {%- if builtin_tools is defined %}\n"
        "            {#- This means we're in ipython mode #}\n"
        '            {{- "<|eom_id|>" }}\n'
        "        {%- else %}\n"
        '            {{- "<|eot_id|>" }}\n'
        "        {%- endif %}\n"
        '    {%- elif message.role == "tool" or message.role == "ipython" %}\n'
        '        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}\n'
        "        {%- if message.content is mapping or message.content is iterable %}\n"
        "            {{- message.content | tojson }}\n"
        "        {%- else %}\n"
        "            {{- message.content }}\n"
        "        {%- endif %}\n"
        '        {{- "<|eot_id|>" }}\n'
        "    {%- endif %}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}\n"
        "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
        "{%- endif %}\n"
    ),
    "qwen2.5-instruct.jinja": (
        "{%- if tools %}\n"
        "    {{- '<|im_start|>system\\n' }}\n"
        "    {%- if messages[0]['role'] == 'system' %}\n"
        "        {{- messages[0]['content'] }}\n"
        "    {%- else %}\n"
        "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful"
        " assistant.' }}\n"
        "    {%- endif %}\n"
        '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist w'
        "ith the user query.\\n\\nYou are provided with function signatures withi"
        'n <tools></tools> XML tags:\\n<tools>" }}\n'
        "    {%- for tool in tools %}\n"
        '        {{- "\\n" }}\n'
        "        {{- tool | tojson }}\n"
        "    {%- endfor %}\n"
        '    {{- "\\n</tools>\\n\\nFor each function call, return a json object wi'
        "th function name and arguments within <tool_call></tool_call> XML tags"
        ':\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-'
        'object>}\\n</tool_call><|im_end|>\\n" }}\n'
        "{%- else %}\n"
        "    {%- if messages[0]['role'] == 'system' %}\n"
        "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_en"
        "d|>\\n' }}\n"
        "    {%- else %}\n"
        "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Clou"
        "d. You are a helpful assistant.<|im_end|>\\n' }}\n"
        "    {%- endif %}\n"
        "{%- endif %}\n"
        "{%- for message in messages %}\n"
        '    {%- if (message.role == "user") or (message.role == "system" and n'
        'ot loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n'
        "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '"
        "<|im_end|>' + '\\n' }}\n"
        '    {%- elif message.role == "assistant" %}\n'
        "        {{- '<|im_start|>' + message.role }}\n"
        "        {%- if message.content %}\n"
        "            {{- '\\n' + message.content }}\n"
        "        {%- endif %}\n"
        "        {%- for tool_call in message.tool_calls %}\n"
        "            {%- if tool_call.function is defined %}\n"
        "                {%- set tool_call = tool_call.function %}\n"
        "            {%- endif %}\n"
        '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
        "            {{- tool_call.name }}\n"
        '            {{- \'", "arguments": \' }}\n'
        "            {{- tool_call.arguments | tojson }}\n"
        "            {{- '}\\n</tool_call>' }}\n"
        "        {%- endfor %}\n"
        "        {{- '<|im_end|>\\n' }}\n"
        '    {%- elif message.role == "tool" %}\n'
        "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role !"
        '= "tool") %}\n'
        "            {{- '<|im_start|>user' }}\n"
        "        {%- endif %}\n"
        "        {{- '\\n<tool_response>\\n' }}\n"
        "        {{- message.content }}\n"
        "        {{- '\\n</tool_response>' }}\n"
        '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
        "            {{- '<|im_end|>\\n' }}\n"
        "        {%- endif %}\n"
        "    {%- endif %}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}\n"
        "    {{- '<|im_start|>assistant\\n' }}\n"
        "{%- endif %}"
    ),
    "smollm2-instruct.jinja": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] "
        "!= 'system' %}{{ '<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n"
        "' + message['content'] + '<|im_end|>' + '\n"
        "'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n"
        "' }}{% endif %}"
    ),
}


# The pre-tokenizer regexes of the real tokenizer.json files.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


WORDS = (
    "the model learns from the text it sees and the loss counts only the targets we choose "
    "quantization packs four bits per weight while adapters train in full precision "
    "système naïve café über straße 東京 数据 🙂 don't can't it's we'll they're I'm "
    "def main(): return 42 if x >= 3.14159 else [a, b] {key: value} #comment"
).split()


def corpus():
    """A few hundred lines of varied text: words, digits, code, runs of spaces and newlines."""
    lines = []
    for i in range(400):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(5 + i % 9)]
        sep = ["\n", "\n\n", "\n\n\n", "  ", " \n"][i % 5]
        lines.append(" ".join(words) + sep + f"system user assistant {i}" + sep)
    return lines


STYLES = {
    # Llama 3.1 Instruct: BOS from the post-processor and from the template; <|eot_id|> ends turns.
    "llama3": dict(
        split=LLAMA3_SPLIT,
        specials=[
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
        bos="<|begin_of_text|>",
        trim_offsets=False,
        config=dict(
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
            tokenizer_class="PreTrainedTokenizerFast",
        ),
        eos_ids=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        template="llama3.1-instruct.jinja",
        template_in="config",
    ),
    # Qwen2.5 Instruct: ChatML, no BOS, a default system message, transformers 5's .jinja file.
    "qwen2.5": dict(
        split=QWEN2_SPLIT,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None,
        trim_offsets=False,
        config=dict(
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            bos_token=None,
            tokenizer_class="Qwen2Tokenizer",
        ),
        eos_ids=["<|im_end|>"],
        template="qwen2.5-instruct.jinja",
        template_in="file",
    ),
    # SmolLM2 Instruct: ChatML, single digits then GPT-2's pre-tokenizer, GPT-2's post-processor
    # (offsets trimmed of spaces), special tokens written as dicts, the template in a list.
    "smollm2": dict(
        split=None,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None,
        trim_offsets=True,
        config=dict(
            bos_token={"__type": "AddedToken", "content": "<|im_start|>", "normalized": False},
            eos_token={"__type": "AddedToken", "content": "<|im_end|>", "normalized": False},
            unk_token="<|endoftext|>",
            pad_token="<|im_end|>",
            tokenizer_class="GPT2Tokenizer",
        ),
        eos_ids=["<|im_end|>"],
        template="smollm2-instruct.jinja",
        template_in="list",
    ),
}


def train_tokenizer(style, vocab_size=600, texts=None):
    """A byte-level BPE shaped like the style's real tokenizer.json, trained on corpus()."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    s = STYLES[style]
    tok = tokenizers.Tokenizer(models.BPE())
    if style == "qwen2.5":
        tok.normalizer = normalizers.NFC()
    if s["split"]:
        split = pre_tokenizers.Split(tokenizers.Regex(s["split"]), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:  # SmolLM2's: single digits, then GPT-2's regex
        digits = pre_tokenizers.Digits(individual_digits=True)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=s["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts or corpus(), trainer)
    byte_level = processors.ByteLevel(trim_offsets=s["trim_offsets"])
    if s["bos"]:
        bos = (s["bos"], tok.token_to_id(s["bos"]))
        template = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    else:
        tok.post_processor = byte_level
    return tok


def pre_tokenizers_module():
    return pytest.importorskip("tokenizers").pre_tokenizers


def make_checkpoint(directory, style, template=None, eos_ids=None, tokenizer=None, **config):
    """A checkpoint directory with the style's tokenizer files; config overrides the config's."""
    s = STYLES[style]
    eos_ids = eos_ids or s["eos_ids"]
    os.makedirs(directory, exist_ok=True)
    tok = tokenizer or train_tokenizer(style)
    tok.save(os.path.join(directory, "tokenizer.json"))
    if template is None:
        template = CHAT_TEMPLATES[s["template"]]
    tokenizer_config = {k: v for k, v in s["config"].items() if v is not None}
    if s["template_in"] == "config":
        tokenizer_config["chat_template"] = template
    elif s["template_in"] == "list":
        tokenizer_config["chat_template"] = [
            {"name": "default", "template": template},
            {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
        ]
    else:
        with open(os.path.join(directory, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(template)
    tokenizer_config.update(config)
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2)
    eos_ids = [tok.token_to_id(t) for t in eos_ids]
    path = os.path.join(directory, "config.json")  # a model's, if there is one: kept
    model_config = json.load(open(path)) if os.path.isfile(path) else {"model_type": "llama"}
    with open(path, "w") as f:
        json.dump({**model_config, "eos_token_id": eos_ids}, f)
    return str(directory)


@pytest.fixture(scope="module", params=list(STYLES))
def checkpoint(request, tmp_path_factory):
    """(style, checkpoint dir, our Tokenizer, transformers' tokenizer) for each style."""
    transformers = pytest.importorskip("transformers")
    style = request.param
    directory = make_checkpoint(tmp_path_factory.mktemp(style), style)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    return style, directory, qf.Tokenizer.load(directory), hf


TEXTS = [
    "the model learns from the text",
    "  leading spaces, trailing ones  ",
    "système naïve café 東京 🙂\n\n\nthree newlines then code: def main(): return 42",
    "<|im_end|> looks like a special token and is one",
    "x",
]


CHATS = [
    [
        {"role": "user", "content": "What does the loss count?"},
        {"role": "assistant", "content": "Only the targets we choose."},
    ],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Pack four bits?"},
        {"role": "assistant", "content": "Per weight, yes."},
        {"role": "user", "content": "And adapters?"},
        {"role": "assistant", "content": "They train in full precision. 🙂"},
    ],
    # A reply that opens with newlines: under ChatML, its first token merges with the "\n" that
    # ends the generation prompt "<|im_start|>assistant\n" (see test_a_token_straddles...).
    [
        {"role": "user", "content": "code?"},
        {"role": "assistant", "content": "\n\n\ndef main(): return 42\n\n"},
    ],
    # Ending on a user turn: the EOS after it (where one is added) is no target.
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ],
]


def token_spans(hf, ids):
    """[(begin, end)] characters of each token, from decoding prefixes: no offsets involved."""
    ends = [len(hf.decode(ids[: k + 1], skip_special_tokens=False)) for k in range(len(ids))]
    return list(zip([0] + ends[:-1], ends))


def reference_chat(hf, messages):
    """(ids, mask) from transformers alone: apply_chat_template, and each prefix rendered."""
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    full = hf.apply_chat_template(messages, tokenize=False)
    mask = np.zeros(len(ids), dtype=bool)
    spans = token_spans(hf, ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = hf.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        after = hf.apply_chat_template(messages[: i + 1], tokenize=False)
        assert full.startswith(after) and after.startswith(before)
        for k, (b, e) in enumerate(spans):
            mask[k] |= b < len(after) and e > len(before)
    return ids, mask


def one(examples, tokenizer):
    """The ids and mask of a single example, as lists."""
    data = qf.tokenize(examples, tokenizer)
    return data.ids.tolist(), data.loss_mask.tolist()


# The tokenizer and the template, against transformers


def test_text_ids_match_transformers(checkpoint):
    """Text: transformers' ids (its BOS where the post-processor adds one), then EOS."""
    style, _, tok, hf = checkpoint
    for text in TEXTS:
        ids, mask = one([qf.Example("t", text=text)], tok)
        assert ids == hf(text)["input_ids"] + [hf.eos_token_id], (style, text)
        assert all(mask)
    assert tok.eos_id == hf.eos_token_id


def test_a_long_text_in_pieces_has_the_ids_of_the_whole(checkpoint, monkeypatch):
    """Cut into pieces where pre-tokens end, a long text encodes to the whole text's ids."""
    _, _, tok, hf = checkpoint
    monkeypatch.setattr(qf, "PIECE", 3)
    alphabet = ["a", "é", "東", "23", " ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", ".", "'s"]
    alphabet += ["🙂", "<|im_end|>", "\u0301"]
    rng = random.Random(0)
    texts = ["".join(rng.choice(alphabet) for _ in range(80)) for _ in range(300)]
    assert sum(len(qf._pieces(tok.backend, text)) for text in texts) > 2 * len(texts)
    assert tok.encode_texts(texts) == hf(texts)["input_ids"]


def test_no_pieces_where_a_text_start_changes_ids(tmp_path):
    """A prefix space (or Llama 2's "▁") changes a text's first ids: such texts stay whole."""
    tok = train_tokenizer("smollm2")
    tok.pre_tokenizer = pre_tokenizers_module().ByteLevel(add_prefix_space=True)
    directory = make_checkpoint(tmp_path, "smollm2", tokenizer=tok)
    assert qf.Tokenizer.load(directory).prefix is None


def test_decode_matches_transformers(checkpoint):
    """decode keeps special tokens, as transformers' decode(skip_special_tokens=False)."""
    _, _, tok, hf = checkpoint
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)


def test_render_matches_apply_chat_template(checkpoint):
    """render gives apply_chat_template(tokenize=False)'s string, with and without a prompt."""
    _, _, tok, hf = checkpoint
    for chat in CHATS:
        for prompt in (False, True):
            want = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
            assert tok.render(chat, prompt) == want


def test_chat_ids_and_mask_match_transformers(checkpoint):
    """A chat's ids are apply_chat_template's; its mask, each prefix rendered by transformers."""
    style, _, tok, hf = checkpoint
    for chat in CHATS:
        ids, mask = one([qf.Example("t", messages=chat)], tok)
        want_ids, want_mask = reference_chat(hf, chat)
        # Every template here ends the chat with an end-of-turn token: no EOS is added.
        assert ids == want_ids, (style, chat)
        assert mask == want_mask.tolist(), (style, chat)


def test_a_token_straddles_the_generation_prompt(checkpoint):
    """The case the offsets are for: a prefix's tokens are not a prefix of the chat's."""
    style, _, tok, hf = checkpoint
    if style == "llama3":
        pytest.skip("Llama 3 trims each message and ends the prompt with a special token")
    chat = CHATS[2]
    before = tok.render(chat[:1], True)
    prefix_ids = hf(before, add_special_tokens=False)["input_ids"]
    ids, mask = one([qf.Example("t", messages=chat)], tok)
    assert ids[: len(prefix_ids)] != prefix_ids
    # The merged token holds the prompt's "\n" and the reply's first newlines: it counts.
    first = mask.index(True)
    assert first == len(prefix_ids) - 1


def test_a_token_straddling_a_turns_end_counts_despite_trimmed_offsets(tmp_path):
    """GPT-2's post-processor trims spaces off offsets; the mask uses untrimmed ones.

    Here the reply's trailing space merges with the next turn's "user" into one token " user":
    it holds an assistant character, so it counts, as it would for any tokenizer whose offsets
    are not trimmed (transformers' own {% generation %} mask misses it under trim_offsets).
    """
    transformers = pytest.importorskip("transformers")
    template = (
        "{% for m in messages %}{{ m['role'] + ':' + m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    directory = make_checkpoint(tmp_path, "smollm2", template=template)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello  "},
        {"role": "user", "content": "\nok"},
    ]
    ids, mask = one([qf.Example("t", messages=chat)], qf.Tokenizer.load(directory))
    want_ids, want_mask = reference_chat(hf, chat)
    # This template ends on no end-of-turn token: the chat gets an EOS (no target after "user").
    assert ids == want_ids + [hf.eos_token_id]
    assert mask == want_mask.tolist() + [False]
    assert mask[hf.convert_ids_to_tokens(ids).index("Ġuser")]


def test_generation_blocks_match_assistant_tokens_mask(tmp_path):
    """With {% generation %} around each reply, transformers' own mask equals ours."""
    transformers = pytest.importorskip("transformers")
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>\\n' }}"
        "{% endgeneration %}{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    directory = make_checkpoint(tmp_path, "qwen2.5", template=template)
    tok = qf.Tokenizer.load(directory)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    for chat in CHATS:
        out = hf.apply_chat_template(
            chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = one([qf.Example("t", messages=chat)], tok)
        assert ids == out["input_ids"]
        assert mask == [bool(m) for m in out["assistant_masks"]]


def test_llama3_bos_is_not_doubled(checkpoint):
    """Llama 3's template writes BOS itself: the chat starts with one BOS, not two."""
    style, _, tok, hf = checkpoint
    ids, _ = one([qf.Example("t", messages=CHATS[0])], tok)
    if style == "llama3":
        assert ids[0] == hf.bos_token_id and ids[1] != hf.bos_token_id
    else:
        assert ids[0] == hf.convert_tokens_to_ids("<|im_start|>")


def test_tojson_keeps_non_ascii(tmp_path):
    """The template's tojson writes "é", not "\\u00e9", as transformers' does."""
    transformers = pytest.importorskip("transformers")
    template = "{{ messages | tojson }}{{ strftime_now('%Y') | length }}"
    directory = make_checkpoint(tmp_path, "qwen2.5", template=template)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    chat = [{"role": "assistant", "content": "café <b>"}]
    got = qf.Tokenizer.load(directory).render(chat, False)
    assert got == hf.apply_chat_template(chat, tokenize=False)
    assert "café <b>" in got


# Prompt/completion and EOS


def test_prompt_completion_mask(checkpoint):
    """Prompt (with special tokens), completion (without) + EOS; only the completion counts."""
    _, _, tok, hf = checkpoint
    prompt = "Q: what does the loss count?\nA:"
    completion = " only the targets."
    ids, mask = one([qf.Example("t", prompt=prompt, completion=completion)], tok)
    p = hf(prompt)["input_ids"]
    c = hf(completion, add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
    assert ids == p + c
    assert mask == [False] * len(p) + [True] * len(c)
    # TRL's way, prompt + completion + EOS as one string, agrees when no token merges across.
    joint = hf(prompt + completion + hf.eos_token)["input_ids"]
    assert joint == ids


def test_eos_after_a_chatml_chat_only_when_eos_is_another_token(tmp_path):
    """ChatML ends with <|im_end|>\\n: no EOS after it, unless the EOS is <|endoftext|>."""
    instruct = qf.Tokenizer.load(make_checkpoint(tmp_path / "a", "smollm2"))
    ids, mask = one([qf.Example("t", messages=CHATS[0])], instruct)
    assert instruct.decode(ids).endswith("<|im_end|>\n")
    eos = "<|endoftext|>"
    base = qf.Tokenizer.load(
        make_checkpoint(tmp_path / "b", "smollm2", eos_ids=[eos], eos_token=eos)
    )
    ids, mask = one([qf.Example("t", messages=CHATS[0])], base)
    assert base.decode(ids).endswith("<|im_end|>\n<|endoftext|>")
    assert mask[-1]  # after an assistant turn the EOS is a target
    ids, mask = one([qf.Example("t", messages=CHATS[3])], base)
    assert ids[-1] == base.eos_id and not mask[-1]  # after a user turn it is not


def test_starts_mark_each_example(checkpoint):
    """starts[i] is where example i begins in the one stream, whatever its form."""
    _, _, tok, _ = checkpoint
    examples = [
        qf.Example("a", text="one"),
        qf.Example("b", messages=CHATS[0]),
        qf.Example("c", prompt="p", completion="c"),
    ]
    data = qf.tokenize(examples, tok)
    lengths = [len(one([e], tok)[0]) for e in examples]
    assert data.starts.tolist() == [0, lengths[0], lengths[0] + lengths[1]]
    assert len(data.ids) == len(data.loss_mask) == sum(lengths)
    assert data.ids.dtype == np.uint16


# Loading a checkpoint


def test_load_without_tokenizer_json_is_none(tmp_path):
    """No tokenizer.json: None, and the caller reads token ids instead."""
    assert qf.Tokenizer.load(str(tmp_path)) is None


def test_without_the_tokenizers_package(tmp_path, monkeypatch):
    """No `tokenizers` installed: one line that says how to get it, or to pass ids instead."""
    directory = make_checkpoint(tmp_path, "qwen2.5")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now fails
    with pytest.raises(qf.UserError) as e:
        qf.Tokenizer.load(directory)
    assert "pip install tokenizers), or pass token ids as .npy" in str(e.value)


def test_chat_template_file_wins_over_the_config(tmp_path):
    """chat_template.jinja (transformers 5) takes precedence over tokenizer_config.json's."""
    directory = make_checkpoint(tmp_path, "llama3")
    with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
        f.write("from the file")
    assert qf.Tokenizer.load(directory).render(CHATS[0], False) == "from the file"


def test_add_bos_token_is_ignored_as_transformers_5_does(tmp_path):
    """With a tokenizer.json, tokenizer_config.json's add_bos_token changes no ids."""
    transformers = pytest.importorskip("transformers")
    directory = make_checkpoint(tmp_path, "llama3", add_bos_token=False, add_eos_token=True)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    ids, _ = one([qf.Example("t", text="the model")], qf.Tokenizer.load(directory))
    assert ids == hf("the model")["input_ids"] + [hf.eos_token_id]
    assert ids[0] == hf.bos_token_id and ids[-2] != hf.eos_token_id


def test_eos_falls_back_to_config_json(tmp_path):
    """No eos_token in tokenizer_config.json: config.json's eos_token_id (the first)."""
    directory = make_checkpoint(tmp_path, "llama3", eos_token=None)
    tok = qf.Tokenizer.load(directory)
    assert tok.eos_id == tok.backend.token_to_id("<|end_of_text|>")


# Bad input: one line naming the file, the line and what is wrong

BAD_FILES = [
    ("a.jsonl", b'{"text": "ok"}\n{"text": \n', "a.jsonl:2: not JSON"),
    ("a.jsonl", b'\n["text"]\n', "a.jsonl:2: not a JSON object"),
    (
        "a.jsonl",
        b'{"txt": "x"}\n',
        "a.jsonl:1: needs text, prompt + completion, or messages (has none)",
    ),
    ("a.jsonl", b'{"text": "x", "messages": []}\n', "(has text, messages)"),
    ("a.jsonl", b'{"text": 3}\n', "a.jsonl:1: 'text' is not a string"),
    (
        "a.jsonl",
        b'{"prompt": "x"}\n',
        "a.jsonl:1: needs text, prompt + completion, or messages (has prompt)",
    ),
    ("a.jsonl", b'{"prompt": "x", "completion": 1}\n', "a.jsonl:1: 'completion' is not a string"),
    ("a.jsonl", b'{"messages": "hi"}\n', "a.jsonl:1: 'messages' is no list of turns"),
    ("a.jsonl", b'{"messages": [{"role": "user"}]}\n', "messages[0] has no 'content' string"),
    ("a.jsonl", b'{"messages": [{"role": "user", "content": "hi"}]}\n', "no assistant turn"),
    ("a.jsonl", b"\n \n", "a.jsonl: the file is empty"),
    ("a.txt", b"", "a.txt: the file is empty"),
    ("a.txt", b"fine\nfine\n\xff\xfe", "a.txt:3: not UTF-8 (byte 0xff)"),
]


@pytest.mark.parametrize("name, content, message", BAD_FILES)
def test_bad_files(tmp_path, name, content, message):
    """Each malformed file is one UserError line naming the file, line and fault."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(qf.UserError) as e:
        qf.read_examples(str(path))
    assert message in str(e.value)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_template_exception_names_the_example(tmp_path):
    """A template's raise_exception is a UserError with its message and the example's line."""
    directory = make_checkpoint(tmp_path / "ckpt", "llama3")
    template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
        f.write(template)
    path = tmp_path / "chats.jsonl"
    lines = [json.dumps({"text": "fine"}), json.dumps({"messages": CHATS[0]})]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(qf.UserError) as e:
        qf.tokenize_file(str(path), directory, str(tmp_path / "cache"))
    assert f"{path}:2: the chat template fails: Conversation roles must alternate" in str(e.value)


def test_template_that_does_not_compile(tmp_path):
    """A template with a syntax error fails at load, naming its file and line."""
    directory = make_checkpoint(tmp_path, "qwen2.5", template="ok\n{% if %}")
    with pytest.raises(qf.UserError) as e:
        qf.Tokenizer.load(directory)
    assert "chat_template.jinja: the chat template does not compile (line 2:" in str(e.value)


def test_template_that_rewrites_earlier_turns(tmp_path):
    """A template that renders a turn one way alone and another inside the chat is refused."""
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% if loop.last %} (last){% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tok = qf.Tokenizer.load(make_checkpoint(tmp_path, "qwen2.5", template=template))
    with pytest.raises(qf.UserError) as e:
        qf.tokenize([qf.Example("c.jsonl:7", messages=CHATS[1])], tok)
    assert "c.jsonl:7: the chat template writes messages[:3] differently" in str(e.value)


# The file end to end: cache, progress


def test_tokenize_file_caches(tmp_path, monkeypatch):
    """A second call loads the .npz; a changed tokenizer file tokenizes anew."""
    directory = make_checkpoint(tmp_path / "ckpt", "qwen2.5")
    path = tmp_path / "data.jsonl"
    rows = [{"text": "a b c"}, {"prompt": "p", "completion": "c"}, {"messages": CHATS[1]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = tmp_path / "cache"
    first = qf.tokenize_file(str(path), directory, str(cache))
    assert len(os.listdir(cache)) == 1 and os.listdir(cache)[0].endswith(".npz")

    def fail(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(qf, "tokenize", fail)
    second = qf.tokenize_file(str(path), directory, str(cache))
    for a, b in zip(first, second):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    with open(os.path.join(directory, "tokenizer_config.json"), "a") as f:
        f.write("\n")
    with pytest.raises(AssertionError, match="tokenized again"):
        qf.tokenize_file(str(path), directory, str(cache))


def test_plain_text_is_one_example(tmp_path):
    """A .txt (or any non-.jsonl) file is one example: its whole text, BOS and EOS around it."""
    transformers = pytest.importorskip("transformers")
    directory = make_checkpoint(tmp_path / "ckpt", "llama3")
    path = tmp_path / "notes.md"
    path.write_text('# Notes\n\nthe model learns\n{"text": "not parsed"}\n')
    data = qf.tokenize_file(str(path), directory, str(tmp_path / "cache"))
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    assert data.ids.tolist() == hf(path.read_text())["input_ids"] + [hf.eos_token_id]
    assert data.starts.tolist() == [0]


def test_progress_lines(tmp_path, monkeypatch):
    """say() hears progress lines while it runs and a summary with MB/s at the end."""
    monkeypatch.setattr(qf, "PROGRESS_S", 0.0)
    monkeypatch.setattr(qf, "TOKENIZE_BATCH", 2)
    directory = make_checkpoint(tmp_path / "ckpt", "smollm2")
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(5)))
    lines = []
    qf.tokenize_file(str(path), directory, str(tmp_path / "cache"), say=lines.append)
    assert lines[0].startswith("tokenized 2/5 examples")
    assert "MB/s" in lines[-1] and "5 examples" in lines[-1]


def chat_checkpoint(directory, style="smollm2"):
    """A micro Llama checkpoint (random weights, 640 ids) with a style's tokenizer (600 ids)."""
    pytest.importorskip("tokenizers")
    config = dataclasses.replace(MICRO, vocab_size=640)
    write_hf_checkpoint(str(directory), config, hf_state_dict(config))
    return make_checkpoint(directory, style)


def chat_file(path, n=24):
    """A .jsonl of chats, prompt/completion pairs and texts, some longer than 32 tokens."""
    rows = []
    for i in range(n):
        chat = [dict(m) for m in CHATS[i % len(CHATS)]]
        chat[0]["content"] += f" ({i})"
        rows.append({"messages": chat} if i % 3 else {"prompt": f"q{i}:", "completion": " a."})
    rows.append({"text": " ".join(WORDS)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


CHAT_RUN = BASE + ["--seq_len", "32", "--batch_size", "2", "--steps", "3"]


def test_chats_fine_tune_from_jsonl_and_from_its_tokenize_to(tmp_path, monkeypatch, capsys):
    """With --checkpoint, a .jsonl of chats, pairs and texts trains as its checkpoint's
    tokenizer reads it (one example a row, a longer one cut into pieces, said in a line); a
    text --prompt is encoded and the sample decoded to text. --tokenize_to writes the .npz of
    tokens, loss_mask and starts and stops; trained from it, the losses are the same. A second
    run reads the cache instead of tokenizing again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = chat_checkpoint(tmp_path / "ckpt")
    data = chat_file(tmp_path / "chats.jsonl")
    argv = CHAT_RUN + ["--checkpoint", ckpt, "--data", data, "--sample", "3", "--prompt", "hi"]
    first = qf.main(argv)
    out = capsys.readouterr().out
    assert "chats.jsonl: 25 examples, " in out and "pieces beyond --seq_len 32" in out
    assert isinstance(first["sample"], str) and len(os.listdir(tmp_path / "cache/qlora_fsdp")) == 1
    npz = str(tmp_path / "chats.npz")
    said = qf.main(["--checkpoint", ckpt, "--data", data, "--tokenize_to", npz])
    assert said["examples"] == 25 and f"wrote {npz}: 25 examples" in capsys.readouterr().out
    with np.load(npz) as z:
        cached = qf.tokenize_file(data, ckpt, str(tmp_path / "cache/qlora_fsdp"))
        for name, array in zip(("tokens", "loss_mask", "starts"), cached):
            assert np.array_equal(z[name], array), name

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(qf, "tokenize", refuse)
    again = qf.main(argv)
    from_npz = qf.main(CHAT_RUN + ["--checkpoint", ckpt, "--data", npz])
    assert first["final_loss"] == again["final_loss"] == from_npz["final_loss"]


def test_examples_one_a_row_attend_causally_without_a_mask(tmp_path, monkeypatch):
    """Examples without --pack go one a row, padded: a row carries no positions, so attention is
    causal with no mask (on CUDA the fused kernel, not flex_attention: the common fine-tune) and
    the loss is the one a document mask of the row gives (the padding's targets count nothing);
    a run of such a file builds no document mask (it used to)."""
    path = str(tmp_path / "examples.npz")
    ids = (np.arange(200) * 7) % 250
    np.savez(path, tokens=ids, loss_mask=np.ones(200, bool), starts=np.array([0, 30, 90, 150]))
    rows = qf.PackedDocuments(qf.load_tokens(path, 256), None, 32, seed=0, per_row=1)
    plan = qf.Plan(batch_size=4, seq_len=32)
    x, y, positions = rows.batch(0, 0, plan, 1, 0)
    assert positions is None
    lengths = [
        len(rows.data.ids[rows.starts[i] :][: rows.lengths[i]])
        for r in range(4)
        for i in rows.row(r)
    ]
    documents = torch.stack([torch.cat([torch.arange(n), torch.arange(32 - n)]) for n in lengths])
    torch.manual_seed(0)
    model = qf.CausalLM(qf.CONFIGS["tiny"], dtype=torch.float32, compile=False)
    with torch.no_grad():
        torch.testing.assert_close(model(x, y, "sum"), model(x, y, "sum", documents))
    monkeypatch.setattr(qf, "document_mask", lambda *a: pytest.fail("a document mask was built"))
    qf.main(BASE + ["--data", path, "--seq_len", "32", "--batch_size", "2", "--steps", "1"])


def chat_stops(ckpt, prompt):
    """A generation_config.json for ckpt whose eos_token_id list holds an id that is no token
    and the 4th token of the base's greedy reply to `prompt` (ids; --lr 0 keeps B at 0, so a run
    samples from the base): the reply stops there. -> the reply's ids before it."""
    base = qf.Llama.from_pretrained(ckpt, dtype=torch.float32)
    greedy = base.generate(prompt, 8)
    end = greedy.index(greedy[3])
    with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [639, greedy[3]]}, f)
    return greedy[:end]


def test_a_chat_prompt_is_a_user_turn_and_the_reply_stops_at_eos(tmp_path, capsys):
    """--chat --prompt TEXT samples a reply to [{"role": "user", "content": TEXT}] rendered with
    the generation prompt, as apply_chat_template(add_generation_prompt=True) writes it; the reply
    stops at any of generation_config.json's eos_token_id (a list), the stop token not shown nor
    in the summary's sample, and the line says it stopped; --out gets samples.jsonl."""
    ckpt = chat_checkpoint(tmp_path / "ckpt")
    tokenizer = qf.Tokenizer.load(ckpt)
    messages = [{"role": "user", "content": "How do I reverse a list?"}]
    prompt = tokenizer.encode_chat(messages)
    rendered = tokenizer.decode(prompt)
    assert rendered.endswith("<|im_start|>assistant\n") and "How do I reverse" in rendered
    reply = chat_stops(ckpt, prompt)
    out = str(tmp_path / "out")
    argv = CHAT_RUN + ["--checkpoint", ckpt, "--lr", "0", "--out", out, "--sample", "8", "--chat"]
    summary = qf.main(argv + ["--prompt", messages[0]["content"]])
    printed = capsys.readouterr().out
    assert f"sample ({len(reply)} tokens, stopped at " in printed
    assert summary["sample"] == tokenizer.decode(reply) and summary["sample_stopped"] is True
    records = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert records == [
        dict(messages=messages, reply=summary["sample"], stopped=True, tokens=len(reply))
    ]


def test_a_prompt_file_gets_a_reply_to_each_chat(tmp_path, capsys):
    """--prompt_file FILE.jsonl answers each {"messages": [...]} line (a last assistant turn is
    held out as the reference), each reply the greedy generate of the rendered chat; printed,
    and written to OUT/samples.jsonl in order; the summary counts them and those that stopped."""
    ckpt = chat_checkpoint(tmp_path / "ckpt")
    tokenizer = qf.Tokenizer.load(ckpt)
    chats = [
        [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"}],
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "a?"},
            {"role": "assistant", "content": "b."},
            {"role": "user", "content": "c?"},
        ],
    ]
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    questions = [chats[0][:1], chats[1], chats[2]]
    base = qf.Llama.from_pretrained(ckpt, dtype=torch.float32)
    replies = [base.generate(tokenizer.encode_chat(q), 5) for q in questions]
    out = str(tmp_path / "out")
    argv = CHAT_RUN + ["--checkpoint", ckpt, "--lr", "0", "--out", out, "--sample", "5"]
    summary = qf.main(argv + ["--prompt_file", str(path)])
    assert "sample 3/3 (5 tokens, reached its length" in capsys.readouterr().out
    assert summary["samples"] == 3 and summary["samples_stopped"] == 0
    records = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert [r["messages"] for r in records] == questions
    assert [r["reply"] for r in records] == [tokenizer.decode(r) for r in replies]
    assert records[0]["reference"] == "7" and "reference" not in records[1]


@pytest.mark.parametrize("dora", [[], ["--dora"]], ids=["lora", "dora"])
def test_a_fine_tune_talks_again_from_its_adapters(tmp_path, dora, capsys):
    """--adapter OUT --steps 0 loads what a run trained (LoRA or DoRA: its adapter_config.json
    says which, and with what rank and alpha) onto the same base and trains nothing: its reply to
    the run's prompt is, token for token, the one the run gave when its training ended, and its
    held-out loss the run's last."""
    ckpt = chat_checkpoint(tmp_path / "ckpt")
    out = str(tmp_path / "out")
    val = ["--val_data", chat_file(tmp_path / "val.jsonl", n=6), "--eval_seqs", "4"]
    asked = ["--checkpoint", ckpt, "--sample", "12", "--chat", "--prompt", "Name a prime."] + val
    argv = CHAT_RUN + ["--lr", "0.5", "--lora_rank", "4", "--lora_alpha", "8"]
    trained = qf.main(argv + dora + asked + ["--out", out])
    again = qf.main(CHAT_RUN + ["--steps", "0", "--adapter", out] + asked)
    printed = capsys.readouterr().out
    assert "eval step 0 | val_loss" in printed and again["steps"] == 0
    assert again["final_loss"] is None and again["step_ms"] is None
    assert again["sample"] == trained["sample"] and len(trained["sample"]) > 0
    assert again["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-6)
    base = qf.main(CHAT_RUN + ["--steps", "0"] + asked)
    assert base["val_loss"] != trained["val_loss"]  # the adapters moved it


def test_a_conversation_on_standard_input(tmp_path, monkeypatch, capsys):
    """--chat with --steps 0 and no --prompt talks: each line of standard input is a user turn,
    each reply printed as it is made (the tokens' text as they come, then the line ends), the
    history kept under the chat template (the second reply is the model's to both turns), until
    the input ends; a turn that the model's context cannot hold ends it, said in one line."""
    ckpt = chat_checkpoint(tmp_path / "ckpt")
    tokenizer = qf.Tokenizer.load(ckpt)
    base = qf.Llama.from_pretrained(ckpt, dtype=torch.float32)
    stop = qf.stop_ids(ckpt)
    history, want = [], []
    for turn in ("Name a prime.", "And another?"):
        history.append({"role": "user", "content": turn})
        ids = base.generate(tokenizer.encode_chat(history), 6, stop=stop)
        ids = ids[:-1] if ids and ids[-1] in stop else ids
        want.append(tokenizer.decode(ids))
        history.append({"role": "assistant", "content": want[-1]})
    streamed = []
    real = qf.generate
    monkeypatch.setattr(
        qf, "generate", lambda *a, **k: (streamed.append(k["each"]), real(*a, **k))[1]
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO("Name a prime.\nAnd another?\n"))
    argv = CHAT_RUN + ["--checkpoint", ckpt, "--steps", "0", "--chat", "--sample", "6"]
    said = qf.main(argv)
    printed = capsys.readouterr().out.splitlines()
    assert said["turns"] == 2 and len(streamed) == 2
    assert printed[-3:-1] == [qf.printable(w) for w in want]  # then the JSON line
    monkeypatch.setattr(sys, "stdin", io.StringIO("x " * 200 + "\n"))
    monkeypatch.setitem(qf.CONFIGS, "micro", MICRO)
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    json.dump({**cfg, "max_position_embeddings": 64}, open(os.path.join(ckpt, "config.json"), "w"))
    assert qf.main(argv)["turns"] == 0
    assert (
        "(the conversation has reached the model's context, 64 tokens)" in capsys.readouterr().out
    )


def test_a_merged_export_stands_alone_and_is_named_as_one(tmp_path, capsys):
    """--merge_to writes the checkpoint's tokenizer and chat template beside the merged weights,
    so that the directory alone is a model with its tokenizer (this file's --checkpoint takes it,
    a chat included); given as --checkpoint, a line says that NF4 would round the fine-tune away
    and to give the base and --adapter instead."""
    ckpt = chat_checkpoint(tmp_path / "ckpt")
    merged = str(tmp_path / "merged")
    qf.main(CHAT_RUN + ["--checkpoint", ckpt, "--merge_to", merged])
    for name in qf.BESIDE_THE_WEIGHTS:
        if os.path.isfile(os.path.join(ckpt, name)):
            assert filecmp.cmp(os.path.join(ckpt, name), os.path.join(merged, name)), name
    assert os.path.isfile(os.path.join(merged, "tokenizer.json"))
    capsys.readouterr()
    said = qf.main(CHAT_RUN + ["--checkpoint", merged, "--steps", "0", "--chat", "--prompt", "hi"])
    assert isinstance(said["sample"], str)
    warned = [line for line in capsys.readouterr().out.splitlines() if "merged export" in line]
    assert len(warned) == 1 and "--adapter" in warned[0]


def test_help_says_what_each_flag_does_and_its_default(capsys):
    """--help names where the recipes are (the README), and every flag has a description; each
    that has a default shows it."""
    with pytest.raises(SystemExit):
        qf.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Recipes: README.md" in text
    parser = qf._Parser()
    qf._add_flags(parser)
    for action in parser._actions[1:]:  # after -h
        assert action.help, action.dest
        if action.default is not None and action.default is not False:
            assert f"(default: {action.default})" in text, action.dest


def test_adapters_that_do_not_fit_are_refused_before_the_base_loads(tmp_path, hf_dir, monkeypatch):
    """--resume's checkpoint and --adapter's tensors are checked against the model's shapes before
    anything is built: a mismatch is one error, and the base is never loaded."""
    out = str(tmp_path / "out")
    argv = BASE + ["--steps", "2", "--batch_size", "2", "--checkpoint", hf_dir[0], "--out", out]
    train_run(argv + ["--stop_at", "1"])
    rewrite_state(out, lambda n, t: (n, torch.zeros(3) if n.startswith("exp_avg/") else t))
    config = json.load(open(os.path.join(out, "adapter_config.json")))
    json.dump({**config, "r": 16}, open(os.path.join(out, "adapter_config.json"), "w"))
    monkeypatch.setattr(qf, "load_model", lambda *a, **k: pytest.fail("the base was loaded"))
    with pytest.raises(qf.UserError, match="AdamW moments are not this model's"):
        qf.fine_tune(qf.parse_args(argv + ["--resume"]))
    with pytest.raises(qf.UserError, match="lora_A .8, 128. is not this model's .\\[16, 128\\]"):
        qf.fine_tune(qf.parse_args(argv[:-2] + ["--adapter", out]))


def test_chat_prompts_refused_in_one_line(tmp_path, hf_dir, capsys):
    """--chat with a checkpoint that has no chat template, and a --prompt_file line that is not a
    chat, are each one error line naming what is wrong."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n")
    ckpt = chat_checkpoint(tmp_path / "ckpt")
    cases = [
        (["--checkpoint", hf_dir[0], "--chat", "--prompt", "hi"], "has no chat template"),
        (["--checkpoint", ckpt, "--prompt_file", str(path)], "p.jsonl:1: --prompt_file takes"),
    ]
    for argv, words in cases:
        with pytest.raises(SystemExit) as exc:
            qf.main(CHAT_RUN + argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1 and words in err[0], err


def test_stop_ids_are_generation_configs_else_config_jsons_and_eos_id(tmp_path):
    """Samples stop at generation_config.json's eos_token_id (one id or a list), else
    config.json's, as transformers' generate reads them, and at --eos_id too."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert qf.stop_ids(str(d)) == [2]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert qf.stop_ids(str(d)) == [128001, 128009]
    assert qf.stop_ids(str(d), 7)[-1] == 7
    assert qf.stop_ids(None, 10) == [10]
    assert qf.stop_ids(None) == []


def test_text_with_a_checkpoint_without_a_tokenizer_is_refused(tmp_path, capsys):
    """A text --data with a checkpoint that has no tokenizer.json (and is not byte-level) is one
    error line before anything is built: never bytes into a BPE vocabulary."""
    config = dataclasses.replace(MICRO, vocab_size=320)
    ckpt = str(tmp_path / "ckpt")
    write_hf_checkpoint(ckpt, config, hf_state_dict(config))
    notes = tmp_path / "notes.txt"
    notes.write_text("plain text\n")
    with pytest.raises(SystemExit) as exc:
        qf.main(BASE + ["--checkpoint", ckpt, "--data", str(notes)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --data {notes}: text needs --checkpoint's tokenizer")


def test_a_bad_jsonl_line_is_one_error_line(tmp_path, capsys):
    """A .jsonl line that is not JSON stops the run with one line naming the file and line."""
    ckpt = chat_checkpoint(tmp_path / "ckpt")
    data = tmp_path / "chats.jsonl"
    data.write_text('{"text": "fine"}\n{"messages": [oops]}\n')
    with pytest.raises(SystemExit):
        qf.main(CHAT_RUN + ["--checkpoint", ckpt, "--data", str(data)])
    assert capsys.readouterr().err.strip().startswith(f"error: {data}:2: not JSON")


def _tokenize_worker(rank, world, port, path, ckpt, cache, out):
    _become_rank(rank, world, port)
    os.environ["XDG_CACHE_HOME"] = cache
    torch.distributed.init_process_group("gloo")
    calls = []
    real = qf.tokenize
    qf.tokenize = lambda *a, **k: (calls.append(1), real(*a, **k))[1]  # noqa: E731
    data = qf.tokenized(path, ckpt, "--data")
    torch.save((len(calls), data.ids.tolist()), f"{out}.{rank}")
    torch.distributed.destroy_process_group()


def test_tokenized_once_per_machine(tmp_path):
    """Two ranks of one machine: local rank 0 tokenizes, the other reads what it cached, and
    both have the same ids."""
    ckpt = chat_checkpoint(tmp_path / "ckpt")
    data = chat_file(tmp_path / "chats.jsonl")
    out = str(tmp_path / "tok")
    spawn(_tokenize_worker, (2, free_port(), data, ckpt, str(tmp_path / "cache"), out), 2)
    (calls0, ids0), (calls1, ids1) = [torch.load(f"{out}.{r}") for r in range(2)]
    assert (calls0, calls1) == (1, 0) and ids0 == ids1


# ---- 16. a run: data files, evaluation, metrics, signals, packing --------------------------------


def test_out_of_memory_is_one_line_and_keeps_the_checkpoint(tmp_path, monkeypatch, capsys):
    """An out-of-memory error in a step is one error line naming the step, the predicted peak, the
    device's memory and --fit, exit code 2; the checkpoint saved before it is untouched."""
    real, calls = qf.train_step, []

    def oom(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(qf, "train_step", oom)
    out = str(tmp_path / "out")
    with pytest.raises(SystemExit) as exc:
        qf.main(BASE + ["--batch_size", "2", "--out", out, "--save_every", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(
        "error: out of memory on cpu at step 2: --estimate predicted a peak of "
    )
    assert "--fit" in err[0] and open(os.path.join(out, "latest")).read() == "checkpoint-1"
    assert qf.load_adapters(os.path.join(out, "checkpoint-1"))


def test_out_of_memory_on_one_rank_ends_every_rank(tmp_path):
    """Under torchrun, an out-of-memory error on rank 1 is its one error line and exit 2, and
    torchrun ends rank 0, which was waiting in a collective: the run stops within seconds, nothing
    left hanging."""
    script = tmp_path / "oom.py"
    # rank 1's second step raises what CUDA raises when it runs out of memory
    script.write_text(
        "\n".join(
            [
                "import sys, torch",
                f"sys.path.insert(0, {HERE!r})",
                "import qlora_fsdp as qf",
                "real = qf.train_step",
                "def oom(*a, **k):",
                "    if torch.distributed.get_rank() == 1 and qf.oom_calls:",
                "        raise torch.OutOfMemoryError('CUDA out of memory')",
                "    qf.oom_calls = 1",
                "    return real(*a, **k)",
                "qf.oom_calls, qf.train_step = 0, oom",
                "qf.main(sys.argv[1:])",
                "",
            ]
        )
    )
    cmd = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(script),
        ]
        + BASE
        + ["--batch_size", "2"]
    )
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert p.returncode != 0
    assert "error: out of memory on cpu at step 2" in p.stderr and "exitcode  : 2" in p.stderr, (
        p.stderr[-3000:]
    )


def val_file(tmp_path):
    """An .npz of 300 tokens whose loss mask counts a target where its id is even: 9 sequences of 32
    + 1."""
    ids = random_ids(300, seed=1)
    np.savez(tmp_path / "val.npz", tokens=ids, loss_mask=(ids % 2 == 0).astype(np.uint8))
    return str(tmp_path / "val.npz"), ids


def test_val_loss_is_the_masked_cross_entropy_of_the_first_sequences(tmp_path):
    """The held-out loss is the plain masked cross entropy of the model's logits over --val_data's
    first --eval_seqs sequences (sequence i: tokens [32 i, 32 i + 33)), all counted targets at once;
    at world 1 (batch 2 per rank: three micro-batches, the last one short) and world 3 (one
    micro-batch, a rank's second row past the end) alike, and with fewer sequences in the file than
    asked, all of them."""
    path, ids = val_file(tmp_path)
    # lr 0: the untrained model
    argv = BASE + ["--val_data", path, "--eval_seqs", "5", "--lr", "0", "--steps", "1"]
    args = qf.parse_args(argv + ["--batch_size", "2"])
    model, _ = build(args, qf.CONFIGS["tiny"])
    val = qf.load_tokens(path, 256, "--val_data")
    want = {}
    for k in (5, 64):
        n = min(k, (len(ids) - 1) // 32)
        seqs = torch.from_numpy(
            np.stack([ids[32 * i : 32 * i + 33] for i in range(n)]).astype(np.int64)
        )
        y = seqs[:, 1:].masked_fill(
            torch.from_numpy(ids[1 : 32 * n + 1].reshape(n, 32) % 2 != 0), -100
        )
        with torch.no_grad():
            want[k] = F.cross_entropy(
                model(seqs[:, :-1]).flatten(0, 1), y.flatten(), ignore_index=-100
            ).item()
        got, got_n = qf.evaluate(model, val, args, k, 1, 0, torch.device("cpu"))
        assert got_n == n == (5 if k == 5 else 9) and got == pytest.approx(want[k], rel=1e-6)
    assert want[5] != pytest.approx(want[64], rel=1e-3)
    sharded = [
        r["summary"]["val_loss"] for r in run_sharded(3, argv + ["--batch_size", "2"], tmp_path)
    ]
    single = train_run(argv + ["--batch_size", "6"])["summary"]["val_loss"]
    assert sharded + [single] == pytest.approx([want[5]] * 4, rel=1e-6)


def test_evaluation_stays_inside_the_training_step_peak(tmp_path):
    """An evaluation allocates at its peak less than a training step's forward of the same
    micro-batch (under no_grad nothing is saved for backward; without checkpointing the forward
    keeps every block's activations), and less than the step's predicted activation peak."""
    path, _ = val_file(tmp_path)
    args = qf.parse_args(BASE + ["--batch_size", "8", "--eval_seqs", "8", "--no-checkpointing"])
    model, _ = build(args, qf.CONFIGS["tiny"])
    val, cpu = qf.load_tokens(path, 256, "--val_data"), torch.device("cpu")
    x, y, _ = qf.get_batch(None, 0, 0, args, 1, 0, 256)
    # the first backward's one-time allocations (the masters' gradients) made
    model(x, y).backward()
    _, forward_peak, _ = _allocated_peak(lambda: model(x, y))
    _, eval_peak, _ = _allocated_peak(lambda: qf.evaluate(model, val, args, 8, 1, 0, cpu))
    assert (
        0 < eval_peak < 0.5 * forward_peak
        and eval_peak
        < qf.estimate_memory(qf.CONFIGS[args.model], qf.Plan.of(args, 1)).activation_peak
    )


def test_metrics_file_has_every_step_once_across_a_resume(tmp_path, monkeypatch):
    """--out's metrics.jsonl holds one record per logged step (step, loss, lr, ms, tokens_per_s,
    mem_gib) and one per evaluation (step, val_loss), written as they come: a run that dies after
    step 3 (checkpoint at 2) keeps them, and its --resume drops the records after step 2 before
    writing its own: every step appears once."""
    path, _ = val_file(tmp_path)
    out = str(tmp_path / "out")
    argv = BASE + [
        "--batch_size",
        "2",
        "--out",
        out,
        "--save_every",
        "2",
        "--val_data",
        path,
        "--eval_every",
        "2",
        "--log_every",
        "1",
    ]
    real, calls = qf.train_step, []

    def dies_at_step_4(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(qf, "train_step", dies_at_step_4)
    with pytest.raises(RuntimeError, match="killed"):
        train_run(argv)
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in records] == [0, 1, 2, 2, 3]  # step 0: the base's val_loss
    monkeypatch.setattr(qf, "train_step", real)
    resumed = train_run(argv + ["--resume"])
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r["step"] for r in records if "loss" in r]
    # Step 0's evaluation is not repeated after --resume.
    assert steps == [1, 2, 3, 4] and [r["step"] for r in records if "val_loss" in r] == [0, 2, 4]
    assert all(
        r.keys() == {"step", "loss", "lr", "ms", "tokens_per_s", "mem_gib"}
        for r in records
        if "loss" in r
    )
    assert (
        records[-1]["val_loss"] == resumed["summary"]["val_loss"]
        and records[-2]["loss"] == resumed["losses"][-1]
    )


def test_a_refused_run_leaves_no_directory_behind(tmp_path, capsys):
    """A run refused before training (here a --val_data that does not exist, found after --out and
    --merge_to were created and test-written) leaves no directory it created, parents included."""
    out, merged = tmp_path / "new" / "out", tmp_path / "merged"
    with pytest.raises(SystemExit):
        qf.main(BASE + ["--out", str(out), "--merge_to", str(merged), "--val_data", "nowhere.npy"])
    assert "--val_data nowhere.npy: no such file" in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and not merged.exists()


def _run_sh_calls(tmp_path, mode, missing):
    """(exit code, stderr, [each call of PYTHON]) of `bash run.sh MODE` with a stand-in Python
    that logs how it is called, lacks the module `missing` until pip installs it, and has no GPU."""
    fake = tmp_path / "python"
    lines = ["#!/bin/sh", f'echo "$@" >> {tmp_path}/calls']
    lines.append(f'case "$*" in *"pip install"*) touch {tmp_path}/installed ;; esac')
    if missing:
        lines.append(
            f'case "$*" in *"import"*"{missing}"*) [ -e {tmp_path}/installed ] || exit 1 ;; esac'
        )
    lines.append('case "$*" in *"device_count"*) echo 0 ;; esac')
    fake.write_text("\n".join(lines) + "\n")
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake)}
    run_sh = ["bash", os.path.join(HERE, "run.sh"), mode]
    p = subprocess.run(run_sh, capture_output=True, text=True, timeout=60, env=env)
    return p.returncode, p.stderr, (tmp_path / "calls").read_text().splitlines()


def _gpu_check(*flags, timeout=120):
    """(exit code, stdout lines, wall seconds) of `bash run.sh gpu FLAGS` with this Python."""
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    run_sh = ["bash", os.path.join(HERE, "run.sh"), "gpu", *flags]
    start = time.monotonic()
    p = subprocess.run(run_sh, capture_output=True, text=True, timeout=timeout, env=env)
    return p.returncode, p.stdout.splitlines(), time.monotonic() - start


@beside("test_gpu_check_dry_run_walks_the_plan_in_order")
def gpu_dry_run(folder):
    return _gpu_check("--dry-run")


def test_gpu_check_dry_run_walks_the_plan_in_order(beside_result):
    """`run.sh gpu --dry-run` on a CPU (run beside the tests): a first line naming torch, CUDA,
    Triton, the GPU, the C compiler, Python.h and pytest; the plan's budgets inside --limit 480;
    then the 7B rows in the plan's order (plain, then --offload_activations), each with the 2 x 3090
    prediction, compile counts and its run's JSON line under it (the stub trainer took the real
    trainer's flags), then the CUDA tests collected; all inside the limit, by the caller's clock
    too."""
    rc, out, wall = beside_result(gpu_dry_run)
    assert rc == 0, "\n".join(out)
    first = out[0]
    for word in ("torch", "CUDA", "Triton", "H100", "C compiler", "Python.h", "pytest"):
        assert word in first, (word, first)
    plan = [line.split()[1:3] for line in out if re.match(r"  \d\. ", line)]
    assert plan == [["llama2-7b", "177"], ["llama2-7b", "--offload_activations"], ["CUDA", "tests"]]
    rows = [i for i, line in enumerate(out) if line.startswith(("llama2-7b", "CUDA tests"))]
    labels = [out[i].split("  ")[0] for i in rows]
    assert labels == ["llama2-7b", "llama2-7b --offload_activations", "CUDA tests (pytest -k cuda)"]
    for i in rows[:2]:
        cells = out[i].split()
        assert "ok" in cells and out[i + 1].strip().startswith("json: {")
        summary = json.loads(out[i + 1].split("json: ", 1)[1])
        assert summary["compiles"] == 4 and summary["recompiles"] == 0
    assert re.search(r"\d+ tests? collected", out[rows[2] + 1]), out[rows[2] + 1]
    seconds = int(
        re.fullmatch(r"dry run: (\d+) s of wall time, inside the 480 s limit", out[-1])[1]
    )
    assert seconds <= wall + 1 and wall < 480


@beside("test_gpu_check_limit_binds")
def gpu_limit(folder):
    return _gpu_check("--dry-run", "--stall", "60", "--limit", "24", "--min_part", "12")


def test_gpu_check_limit_binds(beside_result):
    """--limit binds: stubbed parts that hang (--dry-run --stall 60) under --limit 24 end by
    it, by the caller's clock (beside the tests): the first 7B row killed at its budget (what was
    left; --min_part 12: a part needs 12 s), the parts after it skipped in rows that say so."""
    rc, out, wall = beside_result(gpu_limit)
    assert rc == 0 and wall <= 24, (wall, "\n".join(out))
    rows = {line.split("  ")[0]: line for line in out if line.startswith(("llama2", "CUDA tests"))}
    assert "killed" in rows["llama2-7b"], out
    assert "skipped" in rows["llama2-7b --offload_activations"]
    assert "skipped" in rows["CUDA tests (pytest -k cuda)"]


def test_sigint_stops_at_a_step_saves_and_resumes_exactly(tmp_path):
    """SIGINT in the middle of a run stops it after the step in progress, saves that step's
    checkpoint (with a line: path, step, seconds), prints one line (the step, the checkpoint, the
    command that continues it; no traceback) and exits 130; that command, run, ends where the
    uninterrupted run does, bit for bit."""
    argv = BASE + ["--batch_size", "2", "--steps", "12", "--out", str(tmp_path / "cut")]
    argv += ["--log_every", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    p = subprocess.Popen([sys.executable, qf.__file__, *argv], **pipes)
    for line in p.stdout:
        if line.startswith("step 2/12"):
            p.send_signal(signal.SIGINT)
            break
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    step = int(re.search(r"after step (\d+) of 12", err)[1])
    assert 2 <= step < 12 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"saved {tmp_path / 'cut'}/checkpoint-{step} (step {step}) in " in out
    assert err.rstrip().endswith(" --resume") and "continue it with: python " in err
    resumed = train_run(argv + ["--resume"])
    full = train_run(
        BASE + ["--batch_size", "2", "--steps", "12", "--out", str(tmp_path / "whole")]
    )
    for name, t in full["adapters"].items():
        assert torch.equal(resumed["adapters"][name], t), name


def test_a_signal_after_training_says_what_is_saved(tmp_path, monkeypatch, capsys):
    """A SIGINT during what follows training (here --sample) is one line, exit 130, naming the last
    step and its saved checkpoint and saying the sample was cut short; nothing suggests that
    nothing was saved."""
    real = qf.generate

    def interrupted_generate(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode: inside the sample
        return real(*args, **kwargs)

    monkeypatch.setattr(qf, "generate", interrupted_generate)
    out = tmp_path / "out"
    argv = BASE + ["--batch_size", "2", "--steps", "2", "--out", str(out), "--sample", "4"]
    with pytest.raises(SystemExit) as exc:
        qf.main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 130 and len(err.splitlines()) == 1, err
    assert err == (
        f"interrupted (SIGINT) after step 2 of 2; {out}/checkpoint-2 is saved; the --merge_to or "
        "--sample after it was cut short"
    )
    assert (out / "checkpoint-2" / "training_state.safetensors").is_file()


def test_a_second_signal_during_the_step_stops_at_once():
    """A first SIGINT (or SIGTERM) during training asks the loop to stop after the step in
    progress; a second one stops at once (it used to be ignored), naming the step it cut."""
    signals = qf.Signals()
    signals.run = types.SimpleNamespace(signal=None, step=4)
    signals._handle(signal.SIGINT, None)
    assert signals.run.signal == signal.SIGINT
    with pytest.raises(qf.Interrupted, match="a second time during step 5: stopped at once"):
        signals._handle(signal.SIGTERM, None)


def test_the_continue_command_is_torchruns_on_each_machine(monkeypatch):
    """The command that continues a run repeats its flags with --resume, under torchrun with a
    machine's ranks per node and, across machines, the rendezvous each joins (it used to give
    --nproc_per_node the whole world)."""
    argv = ["--steps", "9", "--out", "runs/a"]
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert qf.continue_command(argv).startswith("python ")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert qf.continue_command(argv).startswith("torchrun --nproc_per_node 2 ")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    said = qf.continue_command(argv)
    launcher = "torchrun --nproc_per_node 8 --nnodes 2 --node_rank 1 --master_addr node0"
    assert said.startswith(launcher + " --master_port 29500 ")
    assert said.endswith("--steps 9 --out runs/a --resume")


def test_peak_memory_off_linux_reads_the_process_peak(monkeypatch):
    """Where /proc/self/status cannot be read (a CPU run off Linux), the peak memory is the
    process's own (getrusage), not an error at the first log line."""
    real = open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_proc)
    assert 0 < qf.peak_memory_gib(torch.device("cpu")) < 1024


def test_a_resumed_summary_covers_the_whole_run(tmp_path, capsys):
    """After --resume the closing line's losses, first_loss and first val_loss cover the whole
    run, read back from metrics.jsonl (and the line says so): they equal the one-shot run's."""
    path, _ = val_file(tmp_path)
    argv = BASE + ["--batch_size", "2", "--steps", "5", "--val_data", path, "--eval_every", "2"]
    argv += ["--log_every", "1"]  # metrics.jsonl then has every step
    whole = train_run(argv + ["--out", str(tmp_path / "a")])["summary"]
    one_shot = [line for line in capsys.readouterr().out.splitlines() if line.startswith("loss ")]
    train_run(argv + ["--out", str(tmp_path / "b"), "--stop_at", "3"])
    resumed = train_run(argv + ["--out", str(tmp_path / "b"), "--resume"])["summary"]
    closing = [line for line in capsys.readouterr().out.splitlines() if line.startswith("loss ")]
    assert closing[-1] == one_shot[0] + " (steps 1-5; 1-3 read back from metrics.jsonl)"
    for key in ("first_loss", "final_loss", "first_val_loss", "val_loss"):
        assert resumed[key] == whole[key], key


def test_step_one_compiling_says_it_is_still_going(monkeypatch, capsys):
    """While step 1 runs with --compile, a line says it is still compiling at least every
    PROGRESS_S (here 0.2 s), as loading does; they stop once step 1 is done."""
    import time

    monkeypatch.setattr(qf, "PROGRESS_S", 0.2)
    real = qf.train_step

    def slow_first(*args, **kwargs):
        if not getattr(slow_first, "done", False):
            time.sleep(1.0)
            slow_first.done = True
        return real(*args, **kwargs)

    monkeypatch.setattr(qf, "train_step", slow_first)
    argv = [a for a in BASE if a != "--no-compile"] + ["--compile", "--batch_size", "2"]
    monkeypatch.setattr(qf, "COMPILE", False)  # the heartbeat, not a compile, is under test
    with monkeypatch.context() as m:
        m.setattr(qf.torch, "compile", lambda fn, **kw: fn)
        train_run(argv + ["--steps", "3"])
    out = capsys.readouterr().out
    beats = [line for line in out.splitlines() if line.startswith("still compiling the first step")]
    assert len(beats) >= 3 and out.index(beats[-1]) < out.index("step 1/3"), out


def test_samples_print_escaped():
    """A sample is printed with repr's escapes for what would not print (control bytes: none
    reaches the terminal), newlines and tabs kept, invalid UTF-8 as its U+FFFD (readable, not an
    escape); the JSON keeps the text itself."""
    assert qf.printable("ab\x00\r\x0bc\n\td\ufffd") == "ab\\x00\\r\\x0bc\n\td\ufffd"


def test_cpu_memory_is_named_rss(capsys):
    """On the CPU the step line's memory figure is `rss` (the process's resident set) and the JSON
    names both figures for what they are: peak_rss_gib and predicted_gpu_peak_gib."""
    summary = train_run(BASE + ["--batch_size", "2", "--steps", "1"])["summary"]
    assert " | rss " in capsys.readouterr().out
    assert summary["peak_rss_gib"] == summary["peak_mem_gib"]
    assert summary["predicted_gpu_peak_gib"] == summary["predicted_peak_gib"]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's VmHWM")
def test_peak_memory_restarts_after_step_1():
    """reset_peak_memory restarts the CPU's peak from the resident set now: a 512 MiB buffer freed
    before it is in the peak before and not after; a run's JSON has the steady state's peak and step
    1's apart. (The buffer is mapped and unmapped itself: a tensor's memory may come from, and go
    back to, what the process's heap already holds, after other tests.)"""
    import mmap

    cpu = torch.device("cpu")
    qf.reset_peak_memory(cpu)
    big = mmap.mmap(-1, 512 * 2**20)
    pages = np.frombuffer(big, dtype=np.uint8)
    pages[::4096] = 1  # each page touched: resident
    del pages
    big.close()
    before = qf.peak_memory_gib(cpu)
    qf.reset_peak_memory(cpu)
    assert qf.peak_memory_gib(cpu) < before - 0.4
    s = train_run(BASE + ["--steps", "2", "--batch_size", "2"])["summary"]
    assert s["peak_mem_gib"] > 0 and s["step1_peak_mem_gib"] > 0 and "peak_reserved_gib" not in s


def test_data_formats_read_the_same_ids(tmp_path):
    """The same ids come back from .npy (any integer dtype), .npz, .bin (uint16), and .txt or any
    other extension (raw bytes: a README.md too); a uint32 .npy of Llama 3 ids up to 128,255
    loads memory-mapped for its 128,256 vocabulary."""
    ids = random_ids(1000)
    writers = {
        "a.npy": lambda f: np.save(f, ids.astype(np.int64)),
        "b.npy": lambda f: np.save(f, ids.astype(np.uint8)),
        "c.npz": lambda f: np.savez(
            f, tokens=ids.astype(np.uint16), loss_mask=np.ones(1000, np.uint8)
        ),
        "d.bin": lambda f: ids.astype(np.uint16).tofile(f),
        "e.txt": lambda f: ids.astype(np.uint8).tofile(f),
        "f.md": lambda f: ids.astype(np.uint8).tofile(f),
        "no_extension": lambda f: ids.astype(np.uint8).tofile(f),
    }
    for name, write in writers.items():
        write(str(tmp_path / name))
        tokens, mask, _ = qf.load_tokens(str(tmp_path / name), 256)
        assert np.array_equal(tokens, ids), name
        assert (mask is not None) == name.endswith(".npz"), name
    llama3 = np.array([0, 128000, 128255] * 20, dtype=np.uint32)
    np.save(tmp_path / "llama3.npy", llama3)
    tokens, _, _ = qf.load_tokens(str(tmp_path / "llama3.npy"), 128256)
    assert isinstance(tokens, np.memmap) and np.array_equal(tokens, llama3)


@pytest.mark.parametrize("flag", ["--out", "--merge_to", "--profile"])
def test_unwritable_output_refused_before_the_first_step(flag, tmp_path, capsys):
    """An output path that cannot be written (here one under a regular file, which fails even as
    root) stops the run at startup with one line naming the flag: no model built, no step taken."""
    (tmp_path / "file").write_text("x")
    path = str(tmp_path / "file" / "sub")
    with pytest.raises(SystemExit) as exc:
        qf.main(BASE + ["--batch_size", "2", flag, path])
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    assert err.strip() == f"error: {flag} {path}: cannot be written (Not a directory)"
    assert "model tiny" not in out and "step 1/" not in out


def test_profile_traces_steps_3_to_5(tmp_path):
    """--profile DIR writes DIR/trace_rank0.json, a Chrome trace of three steps (3-5) with the
    labelled regions the README lists."""
    out = str(tmp_path / "prof")
    run_single(BASE + ["--batch_size", "2", "--steps", "6", "--profile", out])
    with open(os.path.join(out, "trace_rank0.json")) as f:
        names = [e.get("name") for e in json.load(f)["traceEvents"]]
    for label in ("forward", "backward", "optimizer"):
        assert names.count(label) == 3, label
    assert {"fsdp::all_gather", "fsdp::wait_all_gather", "fsdp::copy_out"} <= set(names)


def test_output_paths_checked_without_creating_them(tmp_path):
    """The startup check writes into the nearest directory that exists and creates nothing: no
    directory, no file left behind; the run makes its directories when it writes them."""
    (tmp_path / "kept").mkdir()
    dirs = [str(tmp_path / name / "deeper") for name in ("out", "merged", "kept")]
    qf.check_writable({"--out": dirs[0], "--merge_to": dirs[1], "--profile": dirs[2]}, rank=0)
    assert sorted(os.listdir(tmp_path)) == ["kept"] and os.listdir(tmp_path / "kept") == []


def test_generate_puts_a_list_of_ids_where_the_model_is():
    """generate(model, ids) with ids a list and no device= runs the model on ids on the model's
    device, not the host's: here "meta" stands in for a GPU, and the first forward's tokens are
    seen there (where today's CUDA model would fail on a device mismatch)."""

    class Seen(Exception):
        pass

    def stop(module, args, kwargs):
        raise Seen(args[0].device)

    model = generation_model("llama").to("meta")
    model.register_forward_pre_hook(stop, with_kwargs=True)
    with pytest.raises(Seen) as seen:
        model.generate([3, 1, 4], 2)
    assert seen.value.args[0] == torch.device("meta")


def test_compile_notice_before_the_first_step(monkeypatch, capsys):
    """With --compile (the default) one line before the first step says it compiles and how to
    skip that; with --no-compile there is no such line."""
    # the notice is tested, not the compiler
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(qf, "COMPILE", qf.COMPILE)  # train sets it; restored after the test
    notice = "compiling the first step (about a minute on a CPU); --no-compile skips it"
    for flag in ("--compile", "--no-compile"):
        qf.main(
            [a for a in BASE if a != "--no-compile"] + ["--batch_size", "1", "--steps", "1", flag]
        )
        out = capsys.readouterr().out
        assert (notice in out) == (flag == "--compile")
        if flag == "--compile":
            assert out.index(notice) < out.index("step 1/1")


def test_the_summary_counts_compiles_and_recompiles():
    """compile_counts(), the JSON's compiles and recompiles, counts each frame compiled and each
    compile again after a failed guard: a function compiled for fp32, called again alike, then
    with fp64, adds 2 compiles of which 1 is a recompile. An eager run's summary carries both."""
    before = qf.compile_counts()
    double = torch.compile(lambda x: x * 2, dynamic=False)
    for dtype in (torch.float32, torch.float32, torch.float64):
        double(torch.ones(3, dtype=dtype))
    after = qf.compile_counts()
    assert (after[0] - before[0], after[1] - before[1]) == (2, 1)
    summary = qf.main(BASE + ["--batch_size", "1", "--steps", "1"])
    assert {"compiles", "recompiles"} <= summary.keys()


EOS = 255


def packed_file(tmp_path, n_docs=14, seed=0, name="docs.npy", mask=False):
    """Documents of 2 to 24 tokens (ids below EOS) each ending with EOS, one of 70 (more than a row
    of 32: cut into pieces); as .npz with a loss mask counting every other document when mask."""
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(2, 25, n_docs)]
    lengths[3] = 70
    ids, counted = [], []
    for i, n in enumerate(lengths):
        ids += [int(t) for t in rng.integers(0, EOS, n - 1)] + [EOS]
        counted += [i % 2] * n
    path = str(tmp_path / name)
    if mask:
        np.savez(path, tokens=np.array(ids, dtype=np.uint8), loss_mask=np.array(counted, np.uint8))
    else:
        np.save(path, np.array(ids, dtype=np.uint8))
    return path


PACK = ["--pack", "--eos_id", str(EOS)]


def packed_loss_and_grads(model, fsdp, batch):
    """(summed loss, {name: gradient}) of one packed Batch, then the gradients cleared."""
    loss = model(batch.inputs, batch.targets, reduction="sum", positions=batch.positions)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in fsdp.named_parameters()}
    for p in fsdp.parameters():
        p.grad = None
    return loss.item(), grads


def alone_loss_and_grads(model, fsdp, data, batch_rows):
    """The same documents each run alone, from position 0, with no padding: summed."""
    total = 0.0
    for row in batch_rows:
        for i in row:
            n = int(data.lengths[i])
            doc = data.tensors([[i]])
            inputs = doc.inputs[:, : n - 1]
            targets = doc.targets[:, : n - 1]
            loss = model(inputs, targets, reduction="sum")
            loss.backward()
            total += loss.item()
    grads = {n: p.grad.clone() for n, p in fsdp.named_parameters()}
    for p in fsdp.parameters():
        p.grad = None
    return total, grads


def packed_and_alone(flags, folder):
    """(loss, gradients) of a packed batch by flags and (loss, gradients) of its documents alone,
    the same weights, eager."""
    path = packed_file(folder)
    argv = [a for a in BASE if a != "--no-compile"] + flags + PACK + ["--data", path]
    args = qf.parse_args(argv + ["--batch_size", "2"])
    qf.COMPILE = args.compile  # as train() sets it; a test's fixture restores it
    model, fsdp = build(args, MICRO)
    with torch.no_grad():  # adapters that move the logits, so that their gradients are general
        for name, p in fsdp.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    data = qf.PackedDocuments(qf.load_tokens(path, 256), EOS, 32, args.seed)
    batch = data.batch(0, 0, args, 1, 0)
    rows = [data.row(i) for i in range(2)]
    padding = any(sum(data.lengths[i] for i in row) < 32 for row in rows)
    assert sum(len(r) for r in rows) >= 3 and padding
    packed = packed_loss_and_grads(model, fsdp, batch)
    if args.compile:  # the reference: the same weights, eager blocks
        eager_args = qf.parse_args([a for a in argv if a != "--compile"] + ["--no-compile"])
        model, fsdp = build(eager_args, MICRO)
        with torch.no_grad():
            for name, p in fsdp.named_parameters():
                if name.endswith("lora_B"):
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return packed, alone_loss_and_grads(model, fsdp, data, rows)


@beside("test_packed_batch_equals_its_documents_run_alone")
def packed_compiled(folder):
    return packed_and_alone(["--compile"], pathlib.Path(folder))


@pytest.mark.parametrize(
    "flags",
    [["--no-compile", "--checkpointing"], ["--no-compile", "--no-checkpointing"], ["--compile"]],
    ids=["eager, checkpointed", "eager", "compiled, checkpointed"],
)
def test_packed_batch_equals_its_documents_run_alone(flags, tmp_path, monkeypatch, beside_result):
    """In fp32 the loss and the adapter gradients of a packed batch (two rows of whole documents,
    one cut into pieces, padding at the end) equal the sum over its documents run alone, from
    position 0, with no padding (1e-5 relative): no token attends across a border, positions
    start at 0 in each document, and padding counts nothing. Eager with and without
    checkpointing, and compiled (the reference eager)."""
    if "--compile" in flags:
        (loss, grads), (want_loss, want_grads) = beside_result(packed_compiled)
    else:
        monkeypatch.setattr(qf, "COMPILE", False)  # restored after the test
        (loss, grads), (want_loss, want_grads) = packed_and_alone(flags, tmp_path)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for name, g in want_grads.items():  # 1e-5 of each gradient's scale: sums in another order
        scale = g.abs().max().item()
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("world", [2, 3])
def test_packed_training_sharded_equals_one_process(world, tmp_path):
    """--pack at worlds 2 and 3 (the global batch split into ranks' rows) trains as one process
    does on the same global batch: losses and adapters."""
    argv = BASE + PACK + ["--data", packed_file(tmp_path), "--model", "micro"]
    single = run_single(argv + ["--batch_size", "6"])
    for result in run_sharded(world, argv + ["--batch_size", str(6 // world)], tmp_path):
        assert_same_run(result, single)


def test_packing_keeps_documents_whole_and_draws_them_per_epoch(tmp_path):
    """Every document is in each epoch exactly once; one longer than a row is cut into pieces of
    seq_len, and no other is split; rows hold at most seq_len tokens, in an order drawn per epoch
    from the seed (another seed, another order); a global batch is the same rows at any split (1
    rank x 4 rows, 2 ranks x 2, 2 micro-batches x 2)."""
    data = qf.load_tokens(packed_file(tmp_path), 256)
    packed = qf.PackedDocuments(data, EOS, 32, seed=1)
    ends = np.flatnonzero(np.asarray(data.ids) == EOS) + 1
    spans = list(zip(packed.starts.tolist(), (packed.starts + packed.lengths).tolist()))
    assert spans[3:6] == [(int(ends[2]), int(ends[2]) + 32), (int(ends[2]) + 32, int(ends[2]) + 64),
                          (int(ends[2]) + 64, int(ends[3]))]  # fmt: skip
    assert len(spans) == len(ends) + 2 and all(0 < n <= 32 for n in packed.lengths)
    packed.row(0)
    for epoch in range(3):
        packed.row(packed.first_row[epoch])
        rows = packed.epochs[epoch]
        assert sorted(i for row in rows for i in row) == list(range(len(spans)))
        assert all(sum(packed.lengths[i] for i in row) <= 32 for row in rows)
    assert packed.epochs[0] != packed.epochs[1]
    assert qf.PackedDocuments(data, EOS, 32, seed=2).row(0) != packed.row(0) or (
        qf.PackedDocuments(data, EOS, 32, seed=2).row(1) != packed.row(1)
    )
    base = BASE + PACK
    one = packed.batch(5, 0, qf.parse_args(base + ["--batch_size", "4"]), 1, 0)
    two = [packed.batch(5, 0, qf.parse_args(base + ["--batch_size", "2"]), 2, r) for r in range(2)]
    args = qf.parse_args(base + ["--batch_size", "1", "--grad_accum", "2"])
    four = [packed.batch(5, m, args, 2, r) for m in range(2) for r in range(2)]
    for split in (two, four):
        for field in ("inputs", "targets", "positions"):
            assert torch.equal(getattr(one, field), torch.cat([getattr(b, field) for b in split]))


def test_packed_loss_mask_counts_only_responses(tmp_path):
    """.npz's loss_mask applies to packed rows: a target counts where the mask at the token it
    predicts is 1 (here every other document), never across a border, never on padding."""
    path = packed_file(tmp_path, name="sft.npz", mask=True)
    data = qf.load_tokens(path, 256)
    packed = qf.PackedDocuments(data, EOS, 32, seed=0, shuffle=False)
    batch = packed.tensors([packed.row(i) for i in range(3)])
    for r in range(3):
        at = 0
        for i in packed.row(r):
            start, n = int(packed.starts[i]), int(packed.lengths[i])
            want = torch.from_numpy(np.asarray(data.ids[start + 1 : start + n]).astype(np.int64))
            want[~torch.from_numpy(data.loss_mask[start + 1 : start + n])] = qf.IGNORE_INDEX
            assert torch.equal(batch.targets[r, at : at + n - 1], want)
            assert batch.targets[r, at + n - 1] == qf.IGNORE_INDEX  # no target across a border
            assert torch.equal(batch.positions[r, at : at + n], torch.arange(n))
            at += n
        assert (batch.targets[r, at:] == qf.IGNORE_INDEX).all()
        assert torch.equal(batch.positions[r, at:], torch.arange(32 - at))


def test_packed_val_loss_counts_every_document_once(tmp_path):
    """--val_data with --pack is packed in the file's order; asking for more rows than there are
    evaluates each document once: the val_loss is the mean loss over all documents' targets, as
    if each ran alone."""
    path = packed_file(tmp_path)
    argv = BASE + PACK + ["--val_data", path, "--eval_seqs", "1000", "--lr", "0", "--steps", "1"]
    args = qf.parse_args(argv + ["--data", path, "--batch_size", "3"])
    model, _ = build(args, qf.CONFIGS["tiny"])
    val = qf.PackedDocuments(qf.load_tokens(path, 256), EOS, 32, args.seed, shuffle=False)
    got, rows = qf.evaluate(model, val, args, args.eval_seqs, 1, 0, torch.device("cpu"))
    assert rows == val.first_row[1] < 1000
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(val.lengths)):
            n = int(val.lengths[i])
            doc = val.tensors([[i]])
            loss_sum += model(doc.inputs[:, : n - 1], doc.targets[:, : n - 1], "sum").item()
            count += n - 1
    assert got == pytest.approx(loss_sum / count, rel=1e-5)


def test_packed_resume_equals_uninterrupted(tmp_path):
    """With --pack, stopping after step 2 and --resume gives steps 3-4 of the uninterrupted run,
    bit for bit: the rows of each step depend only on the seed."""
    argv = BASE + PACK + ["--data", packed_file(tmp_path), "--batch_size", "2"]
    full = train_run(argv + ["--out", str(tmp_path / "a")])
    first = train_run(argv + ["--out", str(tmp_path / "b"), "--stop_at", "2"])
    rest = train_run(argv + ["--out", str(tmp_path / "b"), "--resume"])
    assert first["losses"] + rest["losses"] == full["losses"]
    for k, v in full["adapters"].items():
        assert torch.equal(rest["adapters"][k], v), k


@beside("test_packed_step_stays_inside_its_estimate")
def packed_memory(folder):
    qf.CONFIGS["mem"] = MEM
    dtype = mem_dtype()
    return {
        checkpointing: _packed_step_memory(folder, dtype, checkpointing)
        for checkpointing in (True, False)
    }


@pytest.mark.parametrize("checkpointing", [True, False])
def test_packed_step_stays_inside_its_estimate(checkpointing, beside_result):
    """A packed step (eager, the MEM model at 4 x 512, beside the tests, with and without
    checkpointing) allocates within 10% of what --estimate predicts for it, the document mask,
    positions, per-token RoPE and each block's additive mask included; and packing adds what the
    estimate says it adds (within 25%)."""
    (peak, predicted), (plain_peak, plain_predicted) = beside_result(packed_memory)[checkpointing]
    assert peak == pytest.approx(predicted, rel=0.1)
    got = peak - plain_peak
    assert got == pytest.approx(predicted - plain_predicted, rel=0.25), (peak, plain_peak)


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--pack"], "--pack: documents end with an EOS token; give its id with --eos_id"),
        (["--pack", "--eos_id", "300"], "--eos_id 300: not a token of this model"),
        (["--pack", "--eos_id", "1", "--data", "dummy"], "--pack needs documents"),
    ],
)
def test_pack_needs_an_end_of_document(argv, words, capsys):
    """--pack without an EOS id (no --eos_id, no checkpoint config), with one outside the
    vocabulary, or on random tokens is one error line."""
    with pytest.raises(SystemExit) as exc:
        qf.main(BASE + argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_pack_without_compile_on_cuda_is_refused():
    """--pack --no-compile on CUDA would run flex_attention unfused, materializing (B, heads, T, T)
    scores: one line refuses it; compiled, or on the CPU (SDPA's dense mask), it passes."""
    eager = qf.parse_args(["--pack", "--no-compile"])
    with pytest.raises(qf.UserError, match="flex_attention runs unfused"):
        qf.refuse_unfused_attention(eager, torch.device("cuda"))
    qf.refuse_unfused_attention(eager, torch.device("cpu"))
    qf.refuse_unfused_attention(qf.parse_args(["--pack"]), torch.device("cuda"))


# ---- 17. the command line ------------------------------------------------------------------------


def last_json(out):
    return json.loads(out.strip().splitlines()[-1])


BAD_CLI_CASES = [
    "jsonl to a byte model",
    "adapter rank given otherwise",
    "adapter not LoRA",
    "adapter of the head",
    "adapter of another rank",
    "short data",
    "token id",
    "negative token id",
    "bin for a big vocabulary",
    "other extension, as bytes",
    "float tokens",
    "not an array",
    "mask counts nothing",
    "mask values",
    "mask length",
    "prompt not ids",
    "profile too short",
    "non-finite loss",
    "val_data missing",
    "val_data too short",
    "val_data past the vocabulary",
]


@pytest.mark.parametrize("case", BAD_CLI_CASES)
def test_bad_data_or_flag_one_line_error(case, tmp_path, hf_dir, capsys):
    """Each bad data file or flag value exits non-zero with one line `error: ...` naming the file
    or flag and what is wrong, and no traceback."""
    assert_one_line_error(case, tmp_path, hf_dir, capsys)


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--lr", "nan"], "--lr must be a finite number, got nan"),
        (["--temperature", "inf"], "--temperature must be a finite number"),
        (["--lora_dropout", "1.5"], "--lora_dropout must be in [0, 1), got 1.5"),
        (["--batch_size", "0"], "--batch_size must be >= 1, got 0"),
        (["--max_shard_size", "0"], "--max_shard_size must be a positive number"),
        (["--fit", "-1"], "--fit must be a positive number (GB), got -1.0"),
        (["--chat", "--prompt", "hi"], "--chat and --prompt_file need --checkpoint"),
        (["--adapter", "out"], "--adapter needs --checkpoint"),
        (["--prompt_file", "p.jsonl", "--prompt", "hi"], "--prompt and --prompt_file: give one"),
    ],
)
def test_bad_flag_refused_by_the_parser(argv, words, capsys):
    """A flag out of its range stops the run before anything is read or built: exit status 2 and
    argparse's error line naming the flag."""
    with pytest.raises(SystemExit) as exc:
        qf.parse_args(argv)
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_help_lists_every_flag(capsys):
    """--help prints (every help string formats) and names --fit's budget without a number."""
    with pytest.raises(SystemExit) as exc:
        qf.parse_args(["--help"])
    out = capsys.readouterr().out
    assert (
        exc.value.code == 0
        and "--fit [GIB]" in out
        and "10% of the GPU's" in out
        and "--val_data PATH" in out
    )


def test_bad_input_no_traceback_in_a_real_process(tmp_path):
    """From the shell: exit status 2, one line on stderr, no Python traceback."""
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "qlora_fsdp.py"),
            "--checkpoint",
            str(tmp_path / "nope"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip() == f"error: --checkpoint {tmp_path / 'nope'}: no such directory"


def test_one_error_line_under_torchrun(tmp_path):
    """Under torchrun a user error that every rank meets is printed once, on a line of its own,
    and run.sh's launcher adds one line of its own (torchrun's block of a failed child cut)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STEPS": "2"}
    env["EXTRA"] = f"--val_data {tmp_path}/missing.npy --out {tmp_path}/out --no-compile"
    run_sh = ["bash", os.path.join(HERE, "run.sh")]
    p = subprocess.run(run_sh, capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 2, p.stderr
    assert lines[0] == f"error: --val_data {tmp_path}/missing.npy: no such file"
    assert re.fullmatch(r"torchrun: rank \d exited with code 2", lines[1])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("missing", ["pytest", None])
def test_run_sh_installs_what_any_mode_needs(tmp_path, missing):
    """run.sh's modes but gpu make sure torch, numpy and pytest all import before they run: a
    Python without pytest gets the requirements installed, one with all three does not; one start
    of Python checks them and counts the GPUs (here `bench`, whose scripts the stand-in runs)."""
    rc, _, calls = _run_sh_calls(tmp_path, "bench", missing)
    check = "-c import torch, numpy, pytest; print(torch.cuda.device_count())"
    install = "-m pip install -q -r requirements.txt"
    want = [check, install, check] if missing else [check]
    scripts = ["bench_kernels", "bench_step", "bench_vs_torchao"]
    assert rc == 0 and calls == want + [f"benchmarks/{s}.py" for s in scripts]


@pytest.mark.parametrize("missing", ["pytest", "torch", None])
def test_run_sh_gpu_installs_nothing(tmp_path, missing):
    """`run.sh gpu` never installs (a lent GPU machine may be offline): with torch and numpy it
    starts the check at once, pytest or not (the check skips the tests without it, in a row);
    without torch it stops with one line saying that it installs nothing, exit code 2."""
    rc, err, calls = _run_sh_calls(tmp_path, "gpu", missing)
    check = "-c import torch, numpy"
    assert not [c for c in calls if "pip" in c]
    if missing == "torch":
        assert rc == 2 and calls == [check] and len(err.strip().splitlines()) == 1
        assert "installs nothing" in err
    else:
        assert rc == 0 and calls == [check, "benchmarks/gpu_check.py"]


def test_a_rank_that_never_joins_gets_a_hint():
    """Rank 0 of two, whose peer never starts, says within WAIT_HINT_S (here 1 s) that it is
    still waiting, in one line naming the likely causes and the switches (NCCL_P2P_DISABLE=1,
    NCCL_SHM_DISABLE=1, Docker's --shm-size); it goes on waiting."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0"}
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    code = "import qlora_fsdp as qf; qf.WAIT_HINT_S = 1.0; qf.main(['--steps', '1'])"
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=HERE)
    p = subprocess.Popen([sys.executable, "-c", code], **pipes)
    try:
        line = next(line for line in p.stdout if "still waiting" in line)
    finally:
        p.kill()
        p.communicate()
    assert line.startswith("still waiting for the other ranks after 1 s: did every rank start?")
    for switch in ("NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1", "--shm-size"):
        assert switch in line


def test_cli_loss_falls_on_default_data(capsys):
    """`python qlora_fsdp.py` trains the tiny model on its own bytes and the loss falls; the last
    line is the JSON summary. (fp32 at the shapes of the compiled tests above: their graphs.)"""
    qf.main(
        [
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--batch_size",
            "2",
            "--seq_len",
            "32",
            "--steps",
            "80",
            # its data: this file's bytes, which every edit moves
            "--log_every",
            "10",
            "--warmup_steps",
            "5",
        ]
    )
    out = capsys.readouterr().out
    assert "step 80/80 | loss" in out and " tok/s | rss " in out
    s = last_json(out)
    for key in (
        "model",
        "world_size",
        "steps",
        "final_loss",
        "step_ms",
        "tokens_per_s",
        "peak_mem_gib",
    ):
        assert key in s
    assert s["world_size"] == 1 and s["steps"] == 80
    assert s["final_loss"] < s["first_loss"] - 1.0


def test_torchrun_cli_two_processes():
    """`torchrun --nproc_per_node 2 qlora_fsdp.py` runs on CPU over gloo and reports world 2."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        os.path.join(HERE, "qlora_fsdp.py"),
        "--device",
        "cpu",
        "--steps",
        "3",
        "--no-compile",
        "--seq_len",
        "32",
        "--batch_size",
        "2",
    ]
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert p.returncode == 0, p.stderr[-2000:]
    s = last_json(p.stdout)
    assert s["world_size"] == 2 and s["steps"] == 3 and math.isfinite(s["final_loss"])


def test_two_nodes_equal_one_process(single_run_tiny):
    """Two torchrun "nodes" of one process each (--nnodes 2, --node_rank 0 and 1, meeting at
    --master_addr 127.0.0.1) end with the single process's final loss on the same global batch."""
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]
    script = [os.path.join(HERE, "qlora_fsdp.py")] + BASE + ["--batch_size", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            launch + ["--node_rank", str(r)] + script,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=240) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    s = last_json(outs[0][0])
    assert s["world_size"] == 2 and s["steps"] == len(single_run_tiny["losses"])
    assert s["final_loss"] == pytest.approx(single_run_tiny["losses"][-1], abs=1e-5)


# ---- CUDA: the same code with only the device changed (skipped without a GPU) --------------------


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_cuda_offloaded_gradients_go_to_the_host_on_a_stream_of_their_own(monkeypatch):
    """With offload, each reduced gradient is copied to the host on a stream that is not the
    all-gathers' side stream (queued behind the copy, the next unit's all-gather would wait), and
    the gradients equal those of the model kept on the GPU."""
    streams = []
    real = qf._to_host
    monkeypatch.setattr(qf, "_to_host", lambda t, s: (streams.append(s), real(t, s))[1])
    x, y = torch.randint(256, (2, 16)), torch.randint(256, (2, 16))
    grads = []
    for offload in (True, False):
        model = make_model()
        fsdp = qf.FSDP(model, model.units(), "cuda", torch.float32, offload=offload)
        model(x.cuda(), y.cuda()).backward()
        grads.append({n: p.grad.cpu() for n, p in fsdp.named_parameters()})
        if offload:
            assert streams and all(s is not fsdp.side_stream for s in streams)
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, rtol=1e-5, atol=1e-7, msg=name)


@cuda
@pytest.mark.parametrize("compile", [True, False])
def test_cuda_nf4_equals_cpu(compile):
    """Quantizing on the GPU gives the CPU's codes and scales, and dequantizing the same packed
    weight gives the CPU's values, up to where the hardware may round differently: Triton's fp32
    division is approximate and the GPU sums the scales' mean in another order, so a scale may
    differ in its last bits (rtol 1e-6) and a weight exactly on a midpoint between two codes may
    take the neighbouring code; a bf16 value may differ by one unit in the last place."""
    torch.manual_seed(0)
    w = torch.randn(256, 384, dtype=torch.bfloat16)
    cpu, gpu = qf.quantize_nf4(w, compile=compile), qf.quantize_nf4(w.cuda(), compile=compile)
    codes_cpu, codes_gpu = unpack_codes(cpu[0]), unpack_codes(gpu[0].cpu())
    assert (codes_cpu - codes_gpu).abs().max() <= 1 and (
        codes_cpu != codes_gpu
    ).float().mean() < 1e-4
    for a, b in zip(cpu[1:], gpu[1:]):
        torch.testing.assert_close(
            b.cpu().float(), a.float(), rtol=1e-6, atol=1 if a.dtype == torch.int8 else 0
        )
    d_cpu = qf.dequantize_nf4(*cpu, compile=compile)
    d_gpu = qf.dequantize_nf4(*(t.cuda() for t in cpu), compile=compile).cpu()
    torch.testing.assert_close(d_gpu.float(), d_cpu.float(), rtol=2**-7, atol=0)
    t = qf.to_nf4(w)
    assert isinstance(t.cuda(), qf.NF4Tensor) and t.cuda().packed.is_cuda


@cuda
def test_cuda_eager_dequantize_copies_nothing_to_the_gpu():
    """--no-compile on a GPU: after the first call (the codebook, copied once), a dequantize makes
    no host-to-device copy."""
    parts = [t.cuda() for t in qf.quantize_nf4(torch.randn(512, 512), compile=False)]
    qf.dequantize_nf4(*parts, compile=False)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        qf.dequantize_nf4(*parts, compile=False)
        torch.cuda.synchronize()
    assert not [e.name for e in prof.events() if "HtoD" in e.name], (
        "host-to-device copy per dequantize"
    )


@cuda
@pytest.mark.parametrize(
    "extra",
    [
        ["--compile"],
        ["--no-compile"],
        ["--no-compile", "--cpu_offload", "--offload_activations"],
        ["--no-compile", "--dora"],
    ],
)
def test_cuda_training_equals_cpu(extra, hf_dir):
    """One process on the GPU (fp32) gives the CPU run's losses and adapters, compiled and eager,
    with shards, optimizer and block inputs offloaded to the host (side-stream copies), and with
    DoRA (eager: no graph more to compile in the GPU check's time). Both start from one
    checkpoint (a random base drawn on the GPU is another one than the CPU's). Tolerance: matmuls
    and attention sum in another order on the GPU."""
    argv = [a for a in BASE if a not in ("--device", "cpu", "--no-compile")] + [
        "--batch_size",
        "4",
        "--checkpoint",
        hf_dir[0],
    ]
    # eager: compiled equals it (tested above)
    on_cpu = run_single(argv + ["--device", "cpu", "--no-compile"] + extra[1:])
    on_gpu = run_single(argv + ["--device", "cuda"] + extra)
    torch.testing.assert_close(
        torch.tensor(on_gpu["losses"]), torch.tensor(on_cpu["losses"]), rtol=1e-4, atol=1e-4
    )
    for k, v in on_cpu["adapters"].items():
        torch.testing.assert_close(on_gpu["adapters"][k], v, rtol=1e-3, atol=1e-4, msg=k)


@cuda
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_generate_equals_cpu(family):
    """Llama.generate on the GPU (fp32, the KV cache on the GPU) gives the CPU's greedy tokens,
    up to the first step whose two best logits on the CPU are within 1e-3 (a tie either breaks)."""
    model = generation_model(family).eval()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    on_cpu = model.generate(prompt, 24)
    on_gpu = model.to("cuda").generate(prompt, 24, device="cuda")
    model.to("cpu")
    for i, (a, b) in enumerate(zip(on_gpu, on_cpu)):
        if a != b:
            best = model(torch.tensor([prompt + on_cpu[:i]]))[0, -1].topk(2).values
            assert best[0] - best[1] < 1e-3, (i, on_gpu, on_cpu)
            return
    assert on_gpu == on_cpu


@cuda
@pytest.mark.parametrize("extra", [[], ["--offload_activations"]])
def test_cuda_peak_memory_matches_estimate(extra, monkeypatch):
    """On a GPU the steady state's peak (allocated, after step 1) of the default path (compiled,
    checkpointing), over what was allocated before the run (earlier tests' leftovers), is within 10%
    of --estimate's prediction for a model whose activations and weights are both sizeable;
    peak_reserved_gib and step 1's peaks are reported beside it."""
    monkeypatch.setitem(
        qf.CONFIGS,
        "gpu-check",
        qf.LlamaConfig(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5504,
            num_hidden_layers=8,
            num_attention_heads=16,
        ),
    )
    argv = [
        "--device",
        "cuda",
        "--model",
        "gpu-check",
        "--data",
        "dummy",
        "--batch_size",
        "4",
        "--seq_len",
        "1024",
        "--steps",
        "3",
        "--log_every",
        "100",
    ] + extra
    import gc

    # its blocks compiled afresh for their shapes, not dynamic ones after the tests before
    torch._dynamo.reset()
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()  # the estimate counts them: not in what was there before
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated() / qf.GiB
    summary, _, _ = qf.fine_tune(qf.parse_args(argv))
    peak = summary["peak_mem_gib"] - before
    assert abs(peak - summary["predicted_peak_gib"]) <= 0.1 * peak, (before, summary)
    assert (
        summary["peak_reserved_gib"] >= summary["peak_mem_gib"]
        and summary["step1_peak_mem_gib"] > 0
    )


@cuda
def test_cuda_profile_writes_trace_and_memory_snapshot(tmp_path):
    """--profile on CUDA writes the trace and a memory snapshot of the allocator's history, with
    Python stacks only."""
    out = str(tmp_path / "prof")
    run_single(
        [a for a in BASE if a not in ("--device", "cpu")]
        + ["--device", "cuda", "--batch_size", "2", "--steps", "6", "--profile", out]
    )
    assert os.path.isfile(os.path.join(out, "trace_rank0.json"))
    import pickle

    with open(os.path.join(out, "memory_rank0.pickle"), "rb") as f:
        snap = pickle.load(f)
    traces = [e for t in snap["device_traces"] for e in t]
    assert traces and all(
        not any(fr.get("filename", "").endswith((".cpp", ".h")) for fr in e.get("frames", []))
        for e in traces
    )


class _Crossings(torch.utils._python_dispatch.TorchDispatchMode):
    """Records each copy between the host and a device: a _Crossing."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking"))
        elif func is torch.ops.aten._to_copy.default:
            dst, src = out, args[0]
            non_blocking = bool(kwargs.get("non_blocking"))
        else:
            return out
        if dst.device.type != src.device.type:
            host = src if src.device.type == "cpu" else dst
            to_gpu = host is src
            self.copies.append(
                _Crossing(to_gpu, src.dtype, dst.dtype, non_blocking, host.is_pinned())
            )
        return out


class _Crossing(NamedTuple):
    to_gpu: bool
    src: torch.dtype
    dst: torch.dtype
    non_blocking: bool
    pinned: bool  # the host's side


@cuda
def test_cuda_offload_casts_the_masters_on_the_gpu():
    """--cpu_offload, in forward and backward: a gather sends each unit's pinned shard bytes and
    fp32 masters to the GPU as they are, without blocking, and casts the masters to bf16 there;
    the gradients come back the same way. No copy between the host and the GPU changes the dtype
    (such a copy casts on the host, into pageable memory, then copies synchronously), none
    blocks, each uses pinned memory."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    fsdp = qf.FSDP(model, list(model), "cuda", torch.bfloat16, offload=True)
    x = torch.randn(4, 64, device="cuda")
    with _Crossings() as seen:
        model(x).sum().backward()
    torch.cuda.synchronize()
    assert _Crossing(True, torch.float32, torch.float32, True, True) in seen.copies  # masters
    assert _Crossing(False, torch.float32, torch.float32, True, True) in seen.copies  # grads
    for c in seen.copies:
        assert c.src == c.dst and c.non_blocking and c.pinned, c
    assert all(p.grad is not None for p in fsdp.parameters())


# ---- Peers: Hugging Face transformers and PEFT, only where installed (never a dependency) --------


def test_equals_transformers_and_peft_loads_our_adapters(tmp_path):
    """A checkpoint saved by transformers loads here; with the same (dequantized) weights our logits
    equal LlamaForCausalLM's; PEFT loads the adapters we train into that model and its logits equal
    ours; transformers loads our merged checkpoint, in one file and sharded, to the same logits, and
    a checkpoint it saves sharded loads here."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    base, out, merged = str(tmp_path / "base"), str(tmp_path / "out"), str(tmp_path / "merged")
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(base)
    train_run(
        BASE
        + [
            "--checkpoint",
            base,
            "--steps",
            "2",
            "--batch_size",
            "2",
            "--lora_rank",
            "4",
            "--out",
            out,
            "--merge_to",
            merged,
        ]
    )
    ours = qf.Llama.from_pretrained(base, dtype=torch.float32, lora_rank=4).eval()
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    dense = {
        n: p.dequantize(torch.float32) if isinstance(p, qf.NF4Tensor) else p.detach()
        for n, p in ours.named_parameters()
        if not n.endswith(("lora_A", "lora_B"))
    }
    missing, unexpected = hf.load_state_dict(dense, strict=False)
    assert not missing and not unexpected
    tokens = torch.randint(256, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
        ours.load_state_dict(qf.load_adapters(out), strict=False)
        tuned = peft.PeftModel.from_pretrained(hf, out).eval()
        torch.testing.assert_close(ours(tokens), tuned(tokens).logits, rtol=1e-5, atol=1e-5)
        back = transformers.LlamaForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        torch.testing.assert_close(ours(tokens), back(tokens).logits, rtol=1e-5, atol=1e-5)
    sharded, theirs = str(tmp_path / "sharded"), str(tmp_path / "theirs")
    train_run(
        BASE
        + [
            "--checkpoint",
            base,
            "--steps",
            "2",
            "--batch_size",
            "2",
            "--lora_rank",
            "4",
            "--merge_to",
            sharded,
            "--max_shard_size",
            "0.0002",
        ]
    )
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    transformers.LlamaForCausalLM.from_pretrained(base).save_pretrained(
        theirs, max_shard_size="200KB"
    )
    # transformers' own shards
    assert os.path.isfile(os.path.join(theirs, "model.safetensors.index.json"))
    with torch.no_grad():
        back = transformers.LlamaForCausalLM.from_pretrained(sharded, dtype=torch.float32).eval()
        torch.testing.assert_close(ours(tokens), back(tokens).logits, rtol=1e-5, atol=1e-5)
        fresh = [
            qf.Llama.from_pretrained(d, dtype=torch.float32, lora_rank=4).eval()
            for d in (base, theirs)
        ]
        assert torch.equal(fresh[0](tokens), fresh[1](tokens))
        # the adapters compared above moved it
        assert (ours(tokens) - fresh[0](tokens)).abs().max() > 1e-2


# transformers' class and config for each family, tiny, with each family's deltas.
HF_FAMILIES = {
    "llama, tied": ("Llama", dict(tie_word_embeddings=True, attention_bias=True)),
    "mistral": ("Mistral", dict(head_dim=64, sliding_window=None)),
    "qwen2, tied": ("Qwen2", dict(tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3": ("Qwen3", dict(head_dim=64, tie_word_embeddings=False)),
}


def hf_family_checkpoint(transformers, family, path):
    """A random tiny checkpoint of the family saved by transformers, its biases and norms
    nonzero; -> (the class, the model)."""
    name, extra = HF_FAMILIES[family]
    config_cls = getattr(transformers, f"{name}Config")
    model_cls = getattr(transformers, f"{name}ForCausalLM")
    cfg = config_cls(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **extra,
    )
    torch.manual_seed(0)
    model = model_cls(cfg).float()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(path)
    return model_cls, model


def assert_greedy_equals_transformers(ours, theirs, prompt, n):
    """ours.generate (KV cache, stopping at the checkpoint's EOS ids) and transformers'
    generate(do_sample=False) on `theirs` (the merged export) give the same tokens, up to the
    first step where our two best logits are within 1e-3 (a tie either may break)."""
    eos = theirs.generation_config.eos_token_id
    stop = [] if eos is None else eos if isinstance(eos, list) else [eos]
    got = ours.generate(prompt, n, stop=stop)
    tokens = torch.tensor([prompt])
    out = theirs.generate(
        tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=n, do_sample=False
    )
    want = out[0, len(prompt) :].tolist()
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            logits = ours(torch.tensor([prompt + got[:i]]))[0, -1]
            best = logits.topk(2).values
            assert best[0] - best[1] < 1e-3, (i, got, want)
            return
    assert got == want
    return got


def hf_val_loss(model, ids, T, n):
    """The mean cross entropy of the first n sequences [i T, i T + T + 1) of ids, in one batch."""
    rows = torch.stack(
        [torch.as_tensor(ids[i * T : i * T + T + 1], dtype=torch.long) for i in range(n)]
    )
    logits = model(rows[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten()).item()


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_each_family_equals_transformers_and_round_trips(family, tmp_path):
    """For Llama (tied, with attention_bias), Mistral (explicit head_dim), Qwen2 (q, k, v biases,
    tied: no lm_head.weight in the file) and Qwen3 (q_norm, k_norm, explicit head_dim), with
    nonzero biases and norms: from_pretrained's logits equal transformers' <Family>ForCausalLM's
    on the same dequantized weights (1e-4 relative, fp32); PEFT loads the adapters a run trains
    onto that model, every target module matched, to our logits; --merge_to writes a checkpoint
    that transformers loads as the same class, whose loss on --val_data is the run's final
    val_loss."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base, out, merged = str(tmp_path / "base"), str(tmp_path / "out"), str(tmp_path / "merged")
    model_cls, hf = hf_family_checkpoint(transformers, family, base)
    ids = random_ids(600, seed=3)
    np.save(tmp_path / "val.npy", ids)
    run = train_run(
        BASE
        + ["--checkpoint", base, "--steps", "3", "--batch_size", "2", "--lora_rank", "4"]
        + ["--out", out, "--merge_to", merged, "--val_data", str(tmp_path / "val.npy")]
        + ["--eval_seqs", "8"]
    )
    ours = qf.Llama.from_pretrained(base, dtype=torch.float32, lora_rank=4).eval()
    dense = {
        n: p.dequantize(torch.float32) if isinstance(p, qf.NF4Tensor) else p.detach()
        for n, p in ours.named_parameters()
        if not n.endswith(("lora_A", "lora_B"))
    }
    hf.eval()
    missing, unexpected = hf.load_state_dict(dense, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the embedding's
    tokens = torch.randint(256, (2, 24))

    def assert_logits_close(got, want):  # 1e-4 of the logits' scale: fp32 sums in another order
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())

    with torch.no_grad():
        assert_logits_close(ours(tokens), hf(tokens).logits)
        ours.load_state_dict(qf.load_adapters(out), strict=False)
        tuned = peft.PeftModel.from_pretrained(hf, out).eval()
        lora_modules = [n for n, m in tuned.named_modules() if hasattr(m, "lora_A")]
        assert len(lora_modules) == 7 * 2  # every projection of both blocks
        assert_logits_close(ours(tokens), tuned(tokens).logits)
        back = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
        assert type(back) is model_cls
        loss = hf_val_loss(back.eval(), ids, 32, 8)
        assert_greedy_equals_transformers(ours, back, [5, 17, 42, 99, 3], 24)
    assert loss == pytest.approx(run["summary"]["val_loss"], rel=1e-4)
    with open(os.path.join(merged, "config.json")) as f:
        assert json.load(f)["model_type"] == model_cls.config_class.model_type


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("bias", [False, True])
def test_dora_linear_equals_peft(bias, dropout):
    """DoRALinear and PEFT's DoRA layer (LoraConfig(use_dora=True)) over the same dequantized base
    weight, with the same A, B, magnitude and input (and dropout mask), give the same output and
    the same gradients of x, A, B and m, to fp32 rounding."""
    peft = pytest.importorskip("peft")
    ours = dora_layer(bias, dropout)
    holder = torch.nn.Module()
    holder.proj = torch.nn.Linear(128, 96, bias=bias)
    with torch.no_grad():
        holder.proj.weight.copy_(ours.weight.dequantize(torch.float32))
        if bias:
            holder.proj.bias.copy_(ours.bias)
    config = peft.LoraConfig(
        r=4, lora_alpha=8.0, lora_dropout=dropout, use_dora=True, target_modules=["proj"]
    )
    theirs = peft.get_peft_model(holder, config).base_model.model.proj
    named = dict(theirs.named_parameters())
    params = [named[f"{k}.default.weight"] for k in ("lora_A", "lora_B", "lora_magnitude_vector")]
    with torch.no_grad():
        for p, mine in zip(params, [ours.lora_A, ours.lora_B, ours.lora_magnitude_vector]):
            p.copy_(mine)
    ours.train()
    theirs.train()
    x = torch.randn(3, 5, 128)
    got = dora_outputs(ours, ours, x)
    x_theirs = x.clone().requires_grad_()
    torch.manual_seed(5)  # as dora_outputs seeds: the same dropout mask
    y = theirs(x_theirs)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    want = [y.detach(), *torch.autograd.grad(y, [x_theirs, *params], g)]
    for name, a, b in zip(["y", "x", "A", "B", "m"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_peft_loads_our_dora_adapters_and_merges_alike(tmp_path):
    """A --dora run's --out loads into transformers' model with PeftModel.from_pretrained (every
    projection a DoRA layer) and its logits equal ours; its --merge_to, loaded by transformers,
    gives the logits of PEFT's merge_and_unload() of the same adapters."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base, out, merged = str(tmp_path / "base"), str(tmp_path / "out"), str(tmp_path / "merged")
    model_cls, hf = hf_family_checkpoint(transformers, "llama, tied", base)
    argv = ["--checkpoint", base, "--steps", "3", "--batch_size", "2", "--lora_rank", "4"]
    train_run(BASE + argv + ["--dora", "--out", out, "--merge_to", merged])
    ours = qf.Llama.from_pretrained(base, dtype=torch.float32, lora_rank=4, dora=True).eval()
    dense = {
        n: p.dequantize(torch.float32) if isinstance(p, qf.NF4Tensor) else p.detach()
        for n, p in ours.named_parameters()
        if not p.requires_grad
    }
    hf.load_state_dict(dense, strict=False)
    tokens = torch.randint(256, (2, 24))

    def assert_logits_close(got, want):  # 1e-4 of the logits' scale: fp32 sums in another order
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())

    with torch.no_grad():
        ours.load_state_dict(qf.load_adapters(out), strict=False)
        tuned = peft.PeftModel.from_pretrained(hf.eval(), out).eval()
        doras = [n for n, m in tuned.named_modules() if n.endswith("lora_magnitude_vector")]
        assert len(doras) == 7 * 2
        assert_logits_close(ours(tokens), tuned(tokens).logits)
        theirs = tuned.merge_and_unload()(tokens).logits
        back = model_cls.from_pretrained(merged, dtype=torch.float32).eval()
        assert_logits_close(back(tokens).logits, theirs)


SMOLLM2 = os.environ.get("SMOLLM2")  # a SmolLM2-135M-Instruct directory, where there is one


@pytest.mark.skipif(not SMOLLM2, reason="set SMOLLM2 to a SmolLM2-135M-Instruct directory")
def test_smollm2_greedy_chat_equals_transformers_on_the_merged_weights():
    """SmolLM2-135M-Instruct (fp32), with nonzero adapters: a chat prompt rendered by its template
    (--chat's ids) is answered greedily, with the KV cache, as transformers' generate answers it on
    the merged weights (every projection's merged_weight(), what --merge_to writes), stopping at
    its EOS, up to logit ties within 1e-3."""
    transformers = pytest.importorskip("transformers")
    ours = qf.Llama.from_pretrained(SMOLLM2, dtype=torch.float32, lora_rank=8).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in ours.modules():
            if isinstance(m, qf.LoRALinear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.01)
    merged = {}
    for name, m in ours.named_modules():
        if isinstance(m, qf.LoRALinear):
            merged[f"{name}.weight"] = m.merged_weight()
    dense = {n: p.detach() for n, p in ours.named_parameters() if not p.requires_grad}
    dense = {**dense, **merged}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32)
    missing, unexpected = theirs.load_state_dict(dense, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied
    tokenizer = qf.Tokenizer.load(SMOLLM2)
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = tokenizer.encode_chat(question)
    with torch.no_grad():
        got = assert_greedy_equals_transformers(ours, theirs.eval(), prompt, 48)
    assert got is None or got[-1] == tokenizer.backend.token_to_id("<|im_end|>")  # it stopped
