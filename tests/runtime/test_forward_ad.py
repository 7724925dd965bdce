"""Forward-mode AD (``torch.func.jvp``, ``torch.autograd.forward_ad``) through sharded modules.

fsdp2's own tensor work (lazy init's rank check, the all-gathers and their buffers, the
reshards) runs outside ``torch.func`` transforms: inside ``jvp`` a buffer allocated for the
gathered parameters would be the transform's wrapper, dead once ``jvp`` returns, and gloo
cannot read it. The transform sees the gathered parameters as constants. Checked under
mixed precision (bf16 parameters) with the root kept gathered and resharded, with ``jvp``
as the very first call, against torch's ``fully_shard`` and an unsharded bf16 model, and
followed by an ordinary training step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.nn as nn

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from tests._dist import environ, run_on_ranks
from tests._parity import full
from tests._torch import FSDP2_RUNS_UNDER_JVP


def _model(dim: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, dim), nn.LayerNorm(dim), nn.Tanh(), nn.Linear(dim, 4))


def _shard(model: nn.Sequential, fully_shard, policy, reshard_after_forward: bool) -> nn.Sequential:
    for layer in (model[0], model[3]):
        fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def _jvp_then_train(reshard_after_forward: bool, transport: str, dim: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard as torch_fully_shard

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = _model(dim)
    bf16_ref = copy.deepcopy(ref).to(torch.bfloat16)
    with environ(CPU_COLLECTIVES_ENV, transport):
        ours = _shard(copy.deepcopy(ref), fsdp2.fully_shard,
                      fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16), reshard_after_forward)
    theirs = _shard(copy.deepcopy(ref), torch_fully_shard,
                    MixedPrecisionPolicy(param_dtype=torch.bfloat16), reshard_after_forward)
    g = torch.Generator().manual_seed(rank)
    x, v = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    want = torch.func.jvp(bf16_ref, (x.bfloat16(),), (v.bfloat16(),))
    for call in range(2):  # the first call also runs lazy init inside jvp
        got = torch.func.jvp(ours, (x,), (v,))
        torch_got = torch.func.jvp(theirs, (x,), (v,)) if FSDP2_RUNS_UNDER_JVP else got
        for what, a, b, c in zip(("output", "tangent"), got, torch_got, want):
            assert a.dtype == torch.bfloat16, (what, a.dtype)
            torch.testing.assert_close(a, b, msg=lambda m: f"call {call} {what} vs torch: {m}")
            torch.testing.assert_close(a, c, msg=lambda m: f"call {call} {what} vs unsharded: {m}")
    with fwAD.dual_level():  # torch's FSDP2 may refuse this one (a custom Function returning a view)
        got = fwAD.unpack_dual(ours(fwAD.make_dual(x, v)))
        want = fwAD.unpack_dual(bf16_ref(fwAD.make_dual(x.bfloat16(), v.bfloat16())))
    for what, a, c in zip(("output", "tangent"), got, want):
        torch.testing.assert_close(a, c, msg=lambda m: f"forward_ad {what} vs unsharded: {m}")
    for model in (ours, theirs):  # the buffers gathered inside jvp still serve a training step
        model(x).float().square().sum().backward()
    for (name, p), p_theirs in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(full(p.grad), full(p_theirs.grad), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("reshard_after_forward", [False, True])
def test_jvp_under_mixed_precision_matches_torch(reshard_after_forward):
    run_on_ranks(_jvp_then_train, 2, reshard_after_forward, "flat", 16)


def test_jvp_with_exchange_collectives():
    run_on_ranks(_jvp_then_train, 2, False, "exchange", 16)


def _backward_through_jvp(transport: str) -> None:
    """A loss on ``jvp``'s output and tangent (as a Jacobian penalty does), back-propagated
    outside the transform, with a frozen parameter in a group: the same gradients as torch's
    FSDP2 and as the unsharded model averaged over the ranks."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = _model(16)
    ref[0].bias.requires_grad_(False)
    with environ(CPU_COLLECTIVES_ENV, transport):
        ours = _shard(copy.deepcopy(ref), fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy(), True)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    theirs = _shard(copy.deepcopy(ref), torch_fully_shard, MixedPrecisionPolicy(), True)
    g = torch.Generator().manual_seed(rank)
    x, v = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    inputs = {}
    models = (("ref", ref), ("fsdp2", ours), ("torch", theirs))[:3 if FSDP2_RUNS_UNDER_JVP else 2]
    for name, model in models:
        inputs[name] = x.clone().requires_grad_(True)
        out, tangent = torch.func.jvp(model, (inputs[name],), (v,))
        (out.square().sum() + tangent.square().sum()).backward()
    for p in ref.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    for (name, p_ref), p, p_theirs in zip(ref.named_parameters(), ours.parameters(), theirs.parameters()):
        if not FSDP2_RUNS_UNDER_JVP:
            p_theirs = p
        if p_ref.grad is None:
            assert p.grad is None and p_theirs.grad is None, name
            continue
        torch.testing.assert_close(full(p.grad), p_ref.grad, msg=lambda m: f"{name} vs unsharded: {m}")
        torch.testing.assert_close(full(p.grad), full(p_theirs.grad), msg=lambda m: f"{name} vs torch: {m}")
    torch.testing.assert_close(inputs["fsdp2"].grad, inputs["ref"].grad)


@pytest.mark.parametrize("transport", ["flat", "exchange"])
def test_backward_through_jvp_with_a_frozen_parameter(transport):
    run_on_ranks(_backward_through_jvp, 2, transport)
