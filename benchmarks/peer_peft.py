"""The peer of --dora: transformers' LlamaForCausalLM with bitsandbytes' 4-bit NF4 base (double-quantized
scales, bf16 compute) and PEFT's LoRA or DoRA (use_dora=True) on the 7 projections, trained one step at a
time on random tokens, as QLoRA / QDoRA are run with Hugging Face's stack. One process (bitsandbytes' 4-bit
layers do not shard under FSDP2), one thread, non-reentrant activation checkpointing, torch's AdamW.

  python benchmarks/peer_peft.py --shape small-8x128 [--dora] [--steps 12]

The last stdout line is one JSON object with step_ms (the median of the steps after the first two).
Needs transformers, peft and bitsandbytes (never dependencies of qlora_fsdp).
"""

import argparse
import json
import tempfile
import time

import numpy as np
import torch

from _common import BENCH  # noqa: F401 -- puts the repository on sys.path
from bench_step import SHAPES
import qlora_fsdp as qf


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="small-8x128")
    p.add_argument("--dora", action="store_true")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lora_rank", type=int, default=8)
    args = p.parse_args()
    import peft
    import transformers

    torch.set_num_threads(1)
    config, batch, seq = SHAPES[args.shape]
    c = qf.CONFIGS[config] if isinstance(config, str) else config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=max(seq, 1024))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        transformers.LlamaForCausalLM(hf_config).to(torch.bfloat16).save_pretrained(folder)
        quantization = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        model = transformers.LlamaForCausalLM.from_pretrained(
            folder, quantization_config=quantization, dtype=torch.bfloat16, device_map="cpu")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora = peft.LoraConfig(r=args.lora_rank, lora_alpha=16.0, lora_dropout=0.0, use_dora=args.dora,
                           target_modules=qf.TARGET_MODULES, task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(args.steps):
        tokens = torch.randint(c.vocab_size, (batch, seq), generator=g)
        t0 = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss  # shifted inside, as transformers does
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
    step_ms = float(np.median(times[2:])) * 1000
    print(json.dumps(dict(shape=args.shape, dora=args.dora, step_ms=round(step_ms, 2), final_loss=loss.item())))


if __name__ == "__main__":
    main()
