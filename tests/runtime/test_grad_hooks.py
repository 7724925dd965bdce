"""Post-accumulate-grad hooks registered on the sharded parameters.

Autograd accumulates into the unsharded parameters, so it never runs hooks the user put on
the sharded DTensor parameters; fsdp2 runs them once per parameter per backward, when the
gradient shard is final (after the reduce-scatter and, on HSDP, the all-reduce), as torch's
FSDP2 does. Backwards that do not produce the shard (``set_requires_gradient_sync(False)``,
HSDP with ``set_requires_all_reduce(False)``) run none. The use case is the optimizer in
backward (as torchtune does): one optimizer per parameter, stepped and zeroed by the hook,
which must train exactly like one optimizer stepped after backward.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from tests._dist import environ, run_on_ranks
from tests._models import Transformer, lm_loss, make_batch
from tests._parity import full


def _shard(model: nn.Module, fully_shard, mesh=None) -> nn.Module:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _optimizer_in_backward(model: nn.Module, calls: Counter) -> None:
    """One AdamW per parameter, stepped and zeroed by the parameter's own hook."""
    names = {p: n for n, p in model.named_parameters()}
    optimizers = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}

    def step(p: torch.Tensor) -> None:
        calls[names[p]] += 1
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)


def _train_in_backward(hsdp: bool, transport: str) -> list[int]:
    """fsdp2 and torch's FSDP2 with the optimizer in backward, against fsdp2 with one optimizer
    after backward; returns how often each parameter's hook ran, per step, on fsdp2."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    ref = Transformer(n_layers=2)
    with environ(CPU_COLLECTIVES_ENV, transport):
        stepped = _shard(copy.deepcopy(ref), fsdp2.fully_shard, mesh)
        in_backward = _shard(copy.deepcopy(ref), fsdp2.fully_shard, mesh)
    theirs = _shard(copy.deepcopy(ref), torch_fully_shard, mesh)
    calls, torch_calls = Counter(), Counter()
    _optimizer_in_backward(in_backward, calls)
    _optimizer_in_backward(theirs, torch_calls)
    opt = torch.optim.AdamW(stepped.parameters(), lr=1e-2)
    per_step = []
    for step in range(3):
        inputs, targets = make_batch(rank, step)
        lm_loss(stepped(inputs), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for model in (in_backward, theirs):
            lm_loss(model(inputs), targets).backward()
        per_step.append(sorted(set(calls.values())))
        calls.clear()
    for (name, p), p_ours, p_theirs in zip(stepped.named_parameters(), in_backward.parameters(),
                                           theirs.parameters()):
        torch.testing.assert_close(full(p_ours.detach()), full(p.detach()), msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(full(p_ours.detach()), full(p_theirs.detach()), msg=lambda m: f"{name}: {m}")
        assert p_ours.grad is None, name  # the hook zeroed it
    assert len(torch_calls) == len(list(in_backward.parameters()))
    return per_step


@pytest.mark.parametrize("transport", ["flat", "exchange"])
def test_optimizer_in_backward_matches_a_step_after_backward_and_torch(transport):
    assert run_on_ranks(_train_in_backward, 2, False, transport) == [[[1]] * 3] * 2


def test_optimizer_in_backward_on_one_rank():  # no collective: the gradient is the shard
    assert run_on_ranks(_train_in_backward, 1, False, "flat") == [[[1]] * 3]


def test_optimizer_in_backward_on_hsdp():
    assert run_on_ranks(_train_in_backward, 4, True, "flat", timeout=300) == [[[1]] * 3] * 4


def _hooks_under_no_sync(hsdp: bool) -> list[tuple[int, int]]:
    """Two micro-batches, the first without gradient sync (or, on HSDP, without the all-reduce):
    hooks run only in the backward that produces the gradient shard, on fsdp2 as on torch."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    ref = Transformer(n_layers=2)
    models = {"fsdp2": _shard(copy.deepcopy(ref), fsdp2.fully_shard, mesh),
              "torch": _shard(copy.deepcopy(ref), torch_fully_shard, mesh)}
    counts = {}
    for name, model in models.items():
        calls = Counter()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p, calls=calls: calls.update([id(p)]))
        seen = []
        for micro in range(2):
            last = micro == 1
            if hsdp:
                model.set_requires_all_reduce(last)
            else:
                model.set_requires_gradient_sync(last)
            lm_loss(model(make_batch(rank, micro)[0]), make_batch(rank, micro)[1]).backward()
            seen.append(sum(calls.values()))
        counts[name] = seen
    for (pname, p_ours), p_theirs in zip(models["fsdp2"].named_parameters(), models["torch"].parameters()):
        torch.testing.assert_close(full(p_ours.grad), full(p_theirs.grad), msg=lambda m: f"{pname}: {m}")
    assert counts["fsdp2"] == counts["torch"], counts
    return counts["fsdp2"]


def test_no_hooks_in_a_backward_without_gradient_sync():
    n = run_on_ranks(_hooks_under_no_sync, 2, False)[0]
    assert n[0] == 0 and n[1] > 0


def test_no_hooks_in_an_hsdp_backward_without_all_reduce():
    n = run_on_ranks(_hooks_under_no_sync, 4, True, timeout=300)[0]
    assert n[0] == 0 and n[1] > 0
