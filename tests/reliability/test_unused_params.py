"""``set_reduce_scatter_unused_params``: ranks that use different parameters still train.

A branch taken on some ranks only (mixture of experts, data-dependent towers) leaves its
parameters without gradients there. With the setting on, every rank reduces a zero gradient
for each trainable parameter it did not produce one for, so the ranks' reduce-scatters
match, on every CPU transport (gloo's flat collective, which would otherwise abort the
process, and the exchanges by messages or reads, which would otherwise raise), and the
result is DDP's: the average over ranks, counting zeros. Checked against an unsharded
reference and against torch's ``fully_shard`` with the same setting.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from tests._dist import environ, run_on_ranks
from tests._parity import assert_grads_are_average, full
from tests._torch import HAS_REDUCE_SCATTER_UNUSED_PARAMS


class _Routed(nn.Module):
    """``b`` runs only where ``use_b``; ``never`` is trainable and never used."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.never = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = torch.relu(self.a(x))
        return self.b(y) if use_b else y


class _Model(nn.Module):
    """A routed block between two plain ones, so the reduce-scatters' order across groups matters."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.routed = _Routed()
        self.last = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.last(self.routed(self.first(x), use_b))


def _shard(model: _Model, fully_shard) -> _Model:
    for module in (model.first, model.routed, model.last):
        fully_shard(module)
    fully_shard(model)
    model.set_reduce_scatter_unused_params(True)
    return model


def _train_with_rank_dependent_branches(transport: str) -> list[str]:
    """Three steps, rank 0 runs b on steps 0 and 2, rank 1 on step 1: compare the
    parameters and last gradients with the reference and with torch's FSDP2."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = _Model()
    with environ(CPU_COLLECTIVES_ENV, transport):
        ours = _shard(copy.deepcopy(ref), fsdp2.fully_shard)
    # torch before 2.13 has no set_reduce_scatter_unused_params: fsdp2 against the reference alone.
    theirs = _shard(copy.deepcopy(ref), torch_fully_shard) if HAS_REDUCE_SCATTER_UNUSED_PARAMS else ours
    models = {"ref": ref, "fsdp2": ours, "torch": theirs} if HAS_REDUCE_SCATTER_UNUSED_PARAMS else \
        {"ref": ref, "fsdp2": ours}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-2) for name, m in models.items()}
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        use_b = (rank + step) % 2 == 0
        for name, model in models.items():
            opts[name].zero_grad(set_to_none=True)
            model(x, use_b).square().mean().backward()
        for p in ref.parameters():  # DDP's average, zeros where a rank produced none
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        for opt in opts.values():
            opt.step()
    checked = []
    for (name, p_ref), p_ours, p_theirs in zip(ref.named_parameters(), ours.parameters(), theirs.parameters()):
        for what, got, want in (("param", full(p_ours), p_ref.detach()), ("grad", full(p_ours.grad), p_ref.grad),
                                ("torch param", full(p_ours), full(p_theirs)),
                                ("torch grad", full(p_ours.grad), full(p_theirs.grad))):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=f"{name} {what}")
        checked.append(name)
    assert not full(ours.routed.never.grad).any()  # unused everywhere: a zero gradient, as torch gives
    return checked


@pytest.mark.parametrize("transport", ["flat", "exchange", "read"])
def test_ranks_using_different_parameters_train_like_ddp_and_torch(transport):
    checked = run_on_ranks(_train_with_rank_dependent_branches, 2, transport)
    assert checked[0] == checked[1] == [
        "first.weight", "first.bias", "routed.never", "routed.a.weight", "routed.a.bias", "routed.b.weight",
        "routed.b.bias", "last.weight", "last.bias"]


def _forward_without_backward_first() -> list[str]:
    """A forward whose graph is dropped without a backward (evaluation with gradients on) does
    not hold back the next backward: the routed group still reduces right after its module's
    backward on the rank that skipped ``b`` (not at the end, which would reorder the ranks'
    reduce-scatters)."""
    torch.manual_seed(0)
    with environ(CPU_COLLECTIVES_ENV, "exchange"):
        model = _shard(_Model(), fsdp2.fully_shard)
    x = torch.randn(4, 8)
    model(x, True)  # dropped
    with fsdp2.record_schedule() as events:
        model(x, dist.get_rank() == 0).sum().backward()
    return [e for e in events if e.startswith("reduce_scatter")]


def test_a_forward_without_backward_does_not_hold_back_the_next_one():
    assert run_on_ranks(_forward_without_backward_first, 2) == [
        ["reduce_scatter last", "reduce_scatter routed", "reduce_scatter first"]] * 2  # the root holds none


def _checkpointed_routed_block() -> list[list[str]]:
    """Activation checkpointing (non-reentrant, as the recipe uses) around the routed block:
    its recomputation in backward adds no pending forward; the order and the sums hold."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = _Model()
    model = copy.deepcopy(ref)
    model.routed = checkpoint_wrapper(model.routed)
    with environ(CPU_COLLECTIVES_ENV, "exchange"):
        _shard(model, fsdp2.fully_shard)
    orders = []
    for step in range(2):  # gradients accumulate over both steps
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank + 10 * step))
        use_b = (rank + step) % 2 == 0
        with fsdp2.record_schedule() as events:
            model(x, use_b).sum().backward()
        ref(x, use_b).sum().backward()
        orders.append([e for e in events if e.startswith("reduce_scatter")])
    for p in ref.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    assert_grads_are_average(ref, model)
    return orders


def test_activation_checkpointing_keeps_the_order_and_the_sums():
    order = ["reduce_scatter last", "reduce_scatter routed", "reduce_scatter first"]
    assert run_on_ranks(_checkpointed_routed_block, 2) == [[order, order]] * 2


def _off_by_default() -> list[bool]:
    """Off (the default), a parameter no rank used keeps no gradient."""
    torch.manual_seed(0)
    model = _Model()
    for module in (model.first, model.routed, model.last):
        fsdp2.fully_shard(module)
    fsdp2.fully_shard(model)
    model(torch.randn(4, 8), True).sum().backward()
    return [model.routed.never.grad is None, model.routed.b.weight.grad is not None]


def test_off_by_default_unused_parameters_keep_no_gradient():
    assert run_on_ranks(_off_by_default, 2) == [[True, True]] * 2


class _Leaky(_Model):
    """Uses a weight of the routed block before that block's forward (explicitly unsharded)."""

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        x = self.first(x)
        self.routed.unshard()
        x = x + self.routed.a.weight.sum()  # backward reaches this after the routed block's own
        return self.last(self.routed(x, use_b))


def _gradient_after_the_module_reduced() -> str:
    """A parameter whose gradient arrives after its module's backward: an error. (A use
    whose backward needs the weight's values fails earlier, as the module's backward freed
    them.)"""
    torch.manual_seed(0)
    model = _Leaky()
    for module in (model.first, model.routed, model.last):
        fsdp2.fully_shard(module)
    fsdp2.fully_shard(model)
    model.set_reduce_scatter_unused_params(True)
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(4, 8), True).sum().backward()
    return str(info.value)


def test_a_gradient_after_its_module_reduced_is_an_error():
    messages = run_on_ranks(_gradient_after_the_module_reduced, 2)
    assert messages[0] == messages[1]
    assert messages[0].startswith(
        "fsdp2: the gradient of routed.a.weight arrived after routed had reduced its gradients at the end "
        "of its module's backward (set_reduce_scatter_unused_params)"), messages[0]


def _bad_value() -> str:
    model = fsdp2.fully_shard(_Model())
    with pytest.raises(TypeError, match="reduce_scatter_unused_params must be a bool, got 1"):
        model.set_reduce_scatter_unused_params(1)
    return "ok"


def test_setter_wants_a_bool():
    assert run_on_ranks(_bad_value, 1) == ["ok"]
