"""Mixed precision: fsdp2 against torch's own ``fully_shard`` under the same policy.

Both run in the same rank process from the same initial weights on the same data,
and perform the same casts (shard -> ``param_dtype`` before the all-gather, gradient ->
``reduce_dtype`` before the reduce-scatter, reduced shard -> fp32 on the sharded
parameter) and the same collectives (AVG for fp32/bf16; SUM with a divide before and
after for fp16). So losses, gradients and parameters agree bit for bit; any
difference means a cast or a reduction differs from torch's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp2
from tests._dist import run_on_ranks
from tests._models import Transformer, lm_loss, make_batch

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


def _shard_transformer(model: Transformer, fully_shard: Any, policy_cls: Any, mesh: Any,
                       block_mp: dict, root_mp: dict) -> Transformer:
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy_cls(**block_mp))
    fully_shard(model, mesh=mesh, mp_policy=policy_cls(**root_mp))
    return model


def _probe_blocks(model: Transformer, log: list) -> None:
    """Record what each block sees in forward, from a hook registered after fully_shard."""
    def hook(module: nn.Module, args: tuple) -> None:
        weight = module.qkv.weight
        log.append((str(args[0].dtype), str(weight.dtype), type(weight).__name__))

    for block in model.layers:
        block.register_forward_pre_hook(hook)  # runs after fully_shard's (prepended) pre-hook


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _bf16_exact(t: torch.Tensor) -> bool:
    return bool(torch.equal(t, t.to(bf16).to(t.dtype)))


def _train_side_by_side(block_mp: dict, root_mp: dict | None = None, steps: int = 3) -> dict:
    """Train fsdp2 and torch's fully_shard side by side; return what was seen and the max diffs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    root_mp = block_mp if root_mp is None else root_mp
    base = Transformer()
    ours = _shard_transformer(copy.deepcopy(base), fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy,
                              mesh, block_mp, root_mp)
    theirs = _shard_transformer(copy.deepcopy(base), torch_fully_shard, TorchPolicy, mesh, block_mp, root_mp)
    seen: list = []
    seen_theirs: list = []
    _probe_blocks(ours, seen)
    _probe_blocks(theirs, seen_theirs)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    out: dict = {"loss": 0.0, "grad": 0.0, "param": 0.0, "logits": set(), "sharded": set(),
                 "grads_bf16_exact": True}
    for step in range(steps):
        inputs, targets = make_batch(rank, step)
        logits, ref_logits = ours(inputs), theirs(inputs)
        out["logits"].add((str(logits.dtype), str(ref_logits.dtype)))
        loss, ref_loss = lm_loss(logits, targets), lm_loss(ref_logits, targets)
        loss.backward()
        ref_loss.backward()
        out["loss"] = max(out["loss"], _max_diff(loss.detach(), ref_loss.detach()))
        for p, p_ref in zip(ours.parameters(), theirs.parameters()):
            out["sharded"].add((type(p).__name__, str(p.to_local().dtype), type(p.grad).__name__,
                                str(p.grad.to_local().dtype)))
            out["grad"] = max(out["grad"], _max_diff(p.grad.full_tensor(), p_ref.grad.full_tensor()))
            out["grads_bf16_exact"] &= _bf16_exact(p.grad.to_local())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for p, p_ref in zip(ours.parameters(), theirs.parameters()):
            out["param"] = max(out["param"], _max_diff(p.full_tensor(), p_ref.full_tensor()))
    out["seen"], out["seen_theirs"] = sorted(set(seen)), sorted(set(seen_theirs))
    return out


def _check_matches_torch(out: dict, compute: torch.dtype) -> None:
    assert (out["loss"], out["grad"], out["param"]) == (0.0, 0.0, 0.0), out
    # Sharded parameters and their gradients stay fp32 DTensors; forward sees plain
    # unsharded parameters in the compute dtype.
    assert out["sharded"] == {("DTensor", "torch.float32", "DTensor", "torch.float32")}
    assert out["seen"] == out["seen_theirs"] == [(str(compute), str(compute), "Parameter")]


def test_bf16_params_match_torch():
    for out in run_on_ranks(_train_side_by_side, 2, dict(param_dtype=bf16)):
        _check_matches_torch(out, bf16)
        assert out["logits"] == {("torch.bfloat16", "torch.bfloat16")}
        # reduce_dtype defaults to param_dtype: gradients were averaged in bf16.
        assert out["grads_bf16_exact"]


def test_bf16_params_fp32_reduce_match_torch():
    for out in run_on_ranks(_train_side_by_side, 2, dict(param_dtype=bf16, reduce_dtype=fp32)):
        _check_matches_torch(out, bf16)
        # Averaging in fp32 keeps bits a bf16 reduction would round away.
        assert not out["grads_bf16_exact"]


def test_fp16_params_pre_post_divide_match_torch():
    for out in run_on_ranks(_train_side_by_side, 2, dict(param_dtype=fp16)):
        _check_matches_torch(out, fp16)
        assert out["logits"] == {("torch.float16", "torch.float16")}


def test_output_dtype_fp32_with_bf16_params_matches_torch():
    # output_dtype on the root only: the root's norm needs the last block's bf16 output
    # (CPU layer_norm rejects fp32 input with bf16 weights).
    root_mp = dict(param_dtype=bf16, output_dtype=fp32)
    for out in run_on_ranks(_train_side_by_side, 2, dict(param_dtype=bf16), root_mp):
        _check_matches_torch(out, bf16)
        assert out["logits"] == {("torch.float32", "torch.float32")}


class _Probe(nn.Module):
    """Records the dtype its forward receives; computes in its weight's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(str(x.dtype))
        return self.lin(x.to(self.lin.weight.dtype))


def _cast_forward_inputs(cast: bool) -> list:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(1)
    base = _Probe()
    results = []
    for fully_shard, policy_cls in ((fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy),
                                    (torch_fully_shard, TorchPolicy)):
        model = fully_shard(copy.deepcopy(base), mesh=mesh,
                            mp_policy=policy_cls(param_dtype=bf16, cast_forward_inputs=cast))
        hook_saw: list[str] = []
        model.register_forward_pre_hook(lambda _m, args: hook_saw.append(str(args[0].dtype)))
        y = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank())))
        y.sum().backward()
        results.append((model.seen, hook_saw, str(y.dtype), y.detach(), model.lin.weight.grad.full_tensor()))
    (seen, hook_saw, y_dtype, y, grad), (seen_t, hook_saw_t, y_dtype_t, y_t, grad_t) = results
    assert torch.equal(y, y_t) and torch.equal(grad, grad_t)
    return [seen, hook_saw, y_dtype, seen_t, hook_saw_t, y_dtype_t]


@pytest.mark.parametrize("cast", [False, True])
def test_cast_forward_inputs(cast):
    expected = "torch.bfloat16" if cast else "torch.float32"
    for seen, hook_saw, y_dtype, *theirs in run_on_ranks(_cast_forward_inputs, 2, cast):
        assert seen == hook_saw == [expected]
        assert y_dtype == "torch.bfloat16"
        assert theirs == [seen, hook_saw, y_dtype]


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
def test_policy_rejects_non_floating_dtype(field):
    with pytest.raises(ValueError, match=f"MixedPrecisionPolicy.{field} must be a floating-point dtype"):
        fsdp2.MixedPrecisionPolicy(**{field: torch.int32})
    with pytest.raises(TypeError, match=f"MixedPrecisionPolicy.{field} must be a torch.dtype"):
        fsdp2.MixedPrecisionPolicy(**{field: "bfloat16"})
