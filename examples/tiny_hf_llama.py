"""Write a tiny random-weight Hugging Face Llama model folder, a stand-in for a downloaded one.

    python examples/tiny_hf_llama.py OUT_DIR [--tied] [--seed 0]

``LlamaForCausalLM.save_pretrained`` writes ``config.json`` and ``model.safetensors``, exactly
the layout of a model from the Hub, so docs/hf-finetune.md's commands can run with nothing
downloaded. Grouped-query attention (4 heads, 2 key/value heads); a vocabulary of 320, larger
than the recipe's 256 byte tokens. Needs transformers (``pip install -e '.[integration]'``).
"""

from __future__ import annotations

import argparse
import sys

import torch


def write(out: str, *, tied: bool = False, seed: int = 0) -> None:
    """Save a 2-layer, 64-wide random ``LlamaForCausalLM`` to ``out``."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        sys.exit("examples/tiny_hf_llama.py needs transformers: pip install -e '.[integration]'")
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the folder to write (config.json, model.safetensors)")
    parser.add_argument("--tied", action="store_true", help="tie the output projection to the embeddings")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write(args.out, tied=args.tied, seed=args.seed)
    print(f"wrote a random-weight LlamaForCausalLM to {args.out}")


if __name__ == "__main__":
    main()
