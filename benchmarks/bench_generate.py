"""What the KV cache buys: 256 new tokens after a 256-token prompt, in one process, timed three
ways in one run:

  - Llama.generate with its KV cache (the prompt one forward, then one token a step);
  - Llama.generate(cache=False): the whole sequence again for every new token;
  - transformers' generate(do_sample=False) on the merged export (every projection's
    merged_weight(), dense, in the same dtype), its own KV cache.

  python benchmarks/bench_generate.py                          # a random 512-wide Llama
  python benchmarks/bench_generate.py --checkpoint smollm2     # a real one (SmolLM2-135M)

Greedy, exactly --new tokens each (no stop), after an untimed warm-up of each. Ours keeps the base in NF4, so each token
dequantizes every weight; transformers reads dense weights. Each is timed --rounds times, in
turn; a line gives the median. The last line is one JSON object. Needs transformers for its row
(never a dependency of qlora_fsdp).
"""

import argparse
import importlib.util
import json
import time

import numpy as np
import torch

from _common import BENCH  # noqa: F401 -- puts the repository on sys.path
import qlora_fsdp as qf

# A random model's shape when no --checkpoint is given: bench_step.py's 512-wide, with GQA.
WIDE = qf.LlamaConfig(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)


def our_model(args, dtype):
    """Ours (NF4 base, LoRA B nonzero so that the merge matters), in eval mode."""
    torch.manual_seed(0)
    if args.checkpoint:
        model = qf.Llama.from_pretrained(args.checkpoint, dtype=dtype)
    else:
        model = qf.CausalLM(WIDE, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, qf.LoRALinear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.01)
    return model.eval()


def merged_transformers(model, dtype):
    """transformers' LlamaForCausalLM holding what --merge_to writes: the merged weights."""
    import transformers

    c = model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=getattr(c, "tie_word_embeddings", False),
    )
    theirs = transformers.LlamaForCausalLM(hf_config)
    weights = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    for name, m in model.named_modules():
        if isinstance(m, qf.LoRALinear):
            weights[f"{name}.weight"] = m.merged_weight()
    theirs.load_state_dict({n: w.float() for n, w in weights.items()}, strict=False)
    return theirs.to(dtype).eval()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", metavar="DIR", help="a Hugging Face Llama (default: random)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--prompt_len", type=int, default=256)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = qf.DTYPES[args.dtype]
    model = our_model(args, dtype)
    vocab = model.config.vocab_size
    prompt = torch.randint(vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    runs = {
        "ours, KV cache": lambda n: model.generate(prompt, n),
        "ours, no cache": lambda n: model.generate(prompt, n, cache=False),
    }
    if importlib.util.find_spec("transformers") is None:
        print("transformers' generate: not measured (transformers not installed)")
    else:
        theirs = merged_transformers(model, dtype)
        ids = torch.tensor([prompt])
        def hf(n):
            kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False)
            with torch.no_grad():
                out = theirs.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            return out[0, len(prompt) :].tolist()

        runs["transformers, merged"] = hf
    c = model.config
    name = args.checkpoint or "random 512-wide Llama"
    print(
        f"{name}: d {c.hidden_size}, {c.num_hidden_layers} blocks, vocab {vocab}, {args.dtype}, "
        f"{args.threads} threads; {args.new} new tokens after {args.prompt_len}, greedy"
    )
    for run in runs.values():  # compiles (the NF4 kernels), first-touch allocations: untimed
        run(2)
    seconds = {who: [] for who in runs}
    tokens = {}
    for _ in range(args.rounds):
        for who, run in runs.items():
            start = time.perf_counter()
            tokens[who] = run(args.new)
            seconds[who].append(time.perf_counter() - start)
            print(f"  {who:<22} {seconds[who][-1]:8.2f} s", flush=True)
    median = {who: float(np.median(s)) for who, s in seconds.items()}
    for who, s in median.items():
        print(f"{who:<22} {s:8.2f} s  {args.new / s:8.1f} tokens/s")
    cached = median["ours, KV cache"]
    result = dict(seconds={who: round(s, 3) for who, s in median.items()})
    result["cache_speedup"] = round(median["ours, no cache"] / cached, 2)
    print(f"the cache: {result['cache_speedup']:.2f}x the cache-free path")
    if "transformers, merged" in median:
        result["vs_transformers"] = round(median["transformers, merged"] / cached, 3)
        same = tokens["transformers, merged"] == tokens["ours, KV cache"]
        result["same_tokens_as_transformers"] = same
        print(
            f"transformers' generate takes {result['vs_transformers']:.2f}x ours with the cache "
            f"(same tokens: {same})"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
