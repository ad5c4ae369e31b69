"""MB/s of qlora_fsdp.tokenize_file (cold) beside `tokenizers` alone, in one run.

The text is ~100 MB of Python sources found on this machine (the standard library, then
site-packages), one {"text": file} per .jsonl line; a 32k-token BPE in Llama 3's shape is
trained on 8 MB of it. A second file of ~20 MB of chats (Llama 3.1's template) shows what
rendering and the prefix renderings cost. "tokenizers alone" is encode_batch over the same
strings, already in memory: the floor for the library on this machine.

  python benchmarks/bench_tokenize.py [--mb 100] [--chat_mb 20] [--repeat 2]

Needs tokenizers (and the tests' helpers, which build the tokenizer and checkpoint).
"""

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from functools import partial

import tokenizers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import qlora_fsdp as qf  # noqa: E402
import test_qlora_fsdp as tests  # noqa: E402
from qlora_fsdp import tokenize_file  # noqa: E402

SOURCES = [
    os.path.dirname(os.__file__),  # the standard library
    os.path.join(sys.prefix, "lib"),  # site-packages
]


def source_texts(megabytes):
    """Python files' texts, in a fixed order, until they add up to `megabytes`."""
    texts = []
    total = 0
    for root in SOURCES:
        for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            texts.append(text)
            total += len(text.encode())
            if total >= megabytes * 1e6:
                return texts
    return texts


def chats(texts, megabytes):
    """Two-turn chats cut from the texts: a question from one file, a reply from the next."""
    out = []
    total = 0
    for i in range(0, len(texts) - 1, 2):
        question = texts[i][:300]
        reply = texts[i + 1][:3000]
        messages = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And then?"},
            {"role": "assistant", "content": texts[i][300:1500] or "Nothing."},
        ]
        out.append({"messages": messages})
        total += sum(len(m["content"].encode()) for m in messages)
        if total >= megabytes * 1e6:
            break
    return out


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def map_list(fn, batches):
    return [fn(batch, True) for batch in batches]


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=100.0, help="megabytes of text")
    p.add_argument("--chat_mb", type=float, default=20.0, help="megabytes of chats")
    p.add_argument("--repeat", type=int, default=2, help="runs of each; the best counts")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench_tokenize_")
    texts = source_texts(args.mb)
    load = os.getloadavg()[0]
    print(f"tokenizers {tokenizers.__version__}, {os.cpu_count()} CPUs, load {load:.1f}, in {work}")

    sample = texts[: max(1, len(texts) // max(1, int(args.mb / 8)))]
    tok, seconds = timed(lambda: tests.train_tokenizer("llama3", 32000, sample))
    print(
        f"trained a {tok.get_vocab_size():,}-token BPE on {len(sample):,} files in {seconds:.1f} s"
    )
    checkpoint = tests.make_checkpoint(os.path.join(work, "ckpt"), "llama3", tokenizer=tok)
    tokenizer = qf.Tokenizer.load(checkpoint)

    # Text: {"text"} lines, then the same text as one .txt file (one example, in pieces).
    # This machine may be shared: each timing is the best of `repeat`, interleaved.
    path = os.path.join(work, "text.jsonl")
    write_jsonl(path, ({"text": t} for t in texts))
    whole = os.path.join(work, "text.txt")
    with open(whole, "w", encoding="utf-8") as f:
        f.write("".join(texts))
    mb = os.path.getsize(path) / 1e6

    def encode(texts, add_special_tokens):
        return tokenizer.backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    batches = [texts[i : i + qf.TOKENIZE_BATCH] for i in range(0, len(texts), qf.TOKENIZE_BATCH)]
    best = {}
    for r in range(args.repeat):
        cache = os.path.join(work, f"cache{r}")
        say = print if r == 0 else None
        runs = {
            "qlora_fsdp.tokenize_file, cold": partial(tokenize_file, path, checkpoint, cache, say),
            "tokenizers encode_batch_fast, one call": partial(encode, texts, True),
            "tokenizers encode_batch_fast, batches": partial(map_list, encode, batches),
            "qlora_fsdp.tokenize_file, one .txt, cold": partial(
                tokenize_file, whole, checkpoint, cache
            ),
        }
        for name, run in runs.items():
            result, seconds = timed(run)
            best[name] = min(best.get(name, seconds), seconds)
            if name == "qlora_fsdp.tokenize_file, cold":
                tokens = len(result.ids)
    _, cached = timed(lambda: qf.tokenize_file(path, checkpoint, os.path.join(work, "cache0")))
    print(f"\ntext: {len(texts):,} documents, {mb:.1f} MB of .jsonl, {tokens:,} tokens")
    print(f"(the .txt: {os.path.getsize(whole) / 1e6:.1f} MB; each time the best of {args.repeat})")
    for name, seconds in best.items():
        size = os.path.getsize(whole) / 1e6 if ".txt" in name else mb
        print(f"  {name:42} {seconds:6.1f} s  {size / seconds:6.1f} MB/s")
    print(f"  {'qlora_fsdp.tokenize_file, cached':42} {cached:6.2f} s")

    # Chats: {"messages"} lines under Llama 3.1's template.
    rows = chats(texts, args.chat_mb)
    path = os.path.join(work, "chats.jsonl")
    write_jsonl(path, rows)
    mb = os.path.getsize(path) / 1e6
    data, ours = timed(partial(tokenize_file, path, checkpoint, os.path.join(work, "chats"), print))
    fulls, render = timed(lambda: [tokenizer.render(r["messages"], False) for r in rows])
    _, alone = timed(lambda: tokenizer.plain.encode_batch(fulls, add_special_tokens=False))
    print(f"\nchats: {len(rows):,} chats, {mb:.1f} MB, {len(data.ids):,} tokens")
    print(f"  qlora_fsdp.tokenize_file, cold        {ours:6.1f} s  {mb / ours:6.1f} MB/s")
    print(f"  render each chat once (jinja2)        {render:6.1f} s  {mb / render:6.1f} MB/s")
    print(f"  tokenizers encode_batch alone         {alone:6.1f} s  {mb / alone:6.1f} MB/s")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
