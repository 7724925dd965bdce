"""The recipe's model: fsdp2's Llama-style decoder (``fsdp2/models/llama.py``).

It lives in the package so that the memory planner (``python -m fsdp2.plan``) measures this
very model; the recipe imports it from there.
"""

from fsdp2.models.llama import (
    Attention,
    Block,
    FeedForward,
    ModelArgs,
    Transformer,
    apply_rope,
    precompute_rope,
)

__all__ = ["ModelArgs", "Transformer", "Block", "Attention", "FeedForward", "precompute_rope", "apply_rope"]
