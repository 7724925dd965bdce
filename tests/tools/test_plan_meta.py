"""The memory planner on the meta device: the ops it runs are the CPU's (attention included).

(A user's model left on meta is still refused at its first forward: tests/runtime/test_meta_init.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp2.plan._meta_attention import CpuAttention


class _Ops(TorchDispatchMode):
    """Every op with its outputs' shapes, strides and dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.log.append((str(func), [(tuple(t.shape), t.stride(), t.dtype) for t in tree_flatten(out)[0]
                                     if isinstance(t, torch.Tensor)]))
        return out


def _attention_ops(device: str, case: dict) -> list[tuple]:
    torch.manual_seed(0)
    # (batch, seq, heads, head_dim) transposed to (batch, heads, seq, head_dim), as a model does
    q = torch.randn(2, 32, 4, 16, device=device, dtype=case["dtype"]).transpose(1, 2).requires_grad_()
    kv = torch.randn(2, 32, case["kv_heads"], 16, device=device, dtype=case["dtype"]).transpose(1, 2)
    kv.requires_grad_()
    if case.get("strided"):  # the last dim's stride not 1
        q = q.detach().repeat_interleave(2, dim=-1)[..., ::2].requires_grad_()
    mask = torch.ones(32, 32, dtype=torch.bool, device=device).tril() if case.get("mask") else None
    ops = _Ops()
    with ops, CpuAttention():
        out = F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=case["kv_heads"] != 4)
        out.transpose(1, 2).reshape(2, 32, 64).sum().backward()
    return ops.log


@pytest.mark.parametrize("case", [
    dict(dtype=torch.float32, kv_heads=4),
    dict(dtype=torch.bfloat16, kv_heads=2),  # grouped-query attention
    dict(dtype=torch.float32, kv_heads=2, mask=True),  # a boolean mask
    dict(dtype=torch.float32, kv_heads=4, strided=True),  # the CPU's math kernel
], ids=["fp32", "bf16-gqa", "mask", "math"])
def test_attention_on_meta_runs_the_ops_the_cpu_runs(case):
    # Forward and backward: the same ops, outputs of the same shapes, strides and dtypes (what
    # autograd saves and the planner counts). Without CpuAttention the meta device takes the math
    # kernel, whose (batch, heads, seq, seq) attention matrix the CPU's flash kernel never makes.
    cpu, meta = _attention_ops("cpu", case), _attention_ops("meta", case)
    assert meta == cpu
    flash = any("flash_attention" in op for op, _ in cpu)
    assert flash != bool(case.get("strided")), cpu
