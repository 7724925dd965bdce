"""A sample from the trained model, printed at the end of a run (``metrics.sample_tokens``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import ByteTokenizer, HFTokenizer, load_tokenizer
from .llama.model import Transformer


@torch.no_grad()
def generate(model: Transformer, prompt: str, n_tokens: int, device: torch.device, *,
             temperature: float = 0.8, seed: int = 0, multiple_of: int = 1,
             tokenizer: ByteTokenizer | HFTokenizer | None = None) -> str:
    """Sample a continuation of ``prompt``; collective (every rank runs the same forwards).

    ``multiple_of``: inputs are right-padded to a multiple of it (the TP degree: sequence
    parallelism needs even sequence shards). Attention is causal, so padding after the
    last real token never changes its logits.
    """
    tokenizer = tokenizer or load_tokenizer()  # (None: bytes)
    gen = torch.Generator().manual_seed(seed)  # the same draws on every rank
    tokens = torch.tensor([tokenizer.encode(prompt)], device=device)  # (1, seq)
    window = model.args.max_seq_len // multiple_of * multiple_of
    for _ in range(n_tokens):
        context = tokens[:, -window:]
        padded = F.pad(context, (0, -context.shape[1] % multiple_of))  # (1, seq rounded up)
        # (the tokenizer's ids only: a Hugging Face model's vocabulary may be larger)
        logits = model(padded)[0, context.shape[1] - 1, :tokenizer.vocab_size].float().cpu()  # (tokenizer vocab,)
        probs = torch.softmax(logits / temperature, dim=-1)
        next_token = torch.multinomial(probs, 1, generator=gen).to(device)
        tokens = torch.cat([tokens, next_token[None]], dim=1)
    return tokenizer.decode(tokens[0].tolist())
