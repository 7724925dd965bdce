"""Parity driver: train a sharded model and an unsharded reference side by side.

Runs inside a rank (call it from a function passed to ``run_on_ranks``). The
reference is a plain copy of the model whose gradients are averaged with
``all_reduce`` — what data parallelism must compute — and both take AdamW
steps on different data per rank.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tests._models import lm_loss, make_batch

Batch = tuple[Any, Any]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def average_grads(model: nn.Module) -> None:
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def assert_grads_are_average(ref: nn.Module, model: nn.Module, ranks: int | None = None) -> None:
    """``model``'s (sharded) gradients are the average over ``ranks`` (default: the world) of
    ``ref``'s: each rank's unsharded reference ran its own batch. Sums ``ref``'s gradients over
    the world in place."""
    ranks = ranks or dist.get_world_size()
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        dist.all_reduce(p_ref.grad)
        torch.testing.assert_close(full(p.grad), p_ref.grad / ranks, msg=lambda m: f"{name}: {m}")


def assert_params_match(ref: nn.Module, model: nn.Module, *, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    ref_params = dict(ref.named_parameters())
    got_params = dict(model.named_parameters())
    assert ref_params.keys() == got_params.keys(), (sorted(ref_params), sorted(got_params))
    for name, p in ref_params.items():
        with torch.no_grad():  # not .detach(): DTensor's op cache may put it on an equal, older mesh
            got = full(got_params[name])
        assert got.shape == p.shape, (name, got.shape, p.shape)
        torch.testing.assert_close(got.float(), p.detach().float(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def train_parity(
    build: Callable[[], nn.Module],
    shard: Callable[[nn.Module], Any],
    *,
    steps: int = 3,
    lr: float = 1e-2,
    batch: Callable[[int, int], Batch] = make_batch,
    loss_fn: Callable[[Any, Any], torch.Tensor] = lm_loss,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    check_every_step: bool = False,
) -> list[float]:
    """Train ``shard(copy of build())`` against ``build()``; assert losses and params match.

    Returns this rank's sharded-model losses.
    """
    rank = dist.get_rank()
    ref = build()
    model = copy.deepcopy(ref)
    shard(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        inputs, targets = batch(rank, step)
        ref_loss = loss_fn(ref(inputs), targets)
        ref_loss.backward()
        average_grads(ref)
        ref_opt.step()
        ref_opt.zero_grad()

        loss = loss_fn(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss.detach().float(), ref_loss.detach().float(), atol=atol, rtol=rtol,
                                   msg=lambda m: f"step {step} loss: {m}")
        losses.append(loss.item())
        if check_every_step:
            assert_params_match(ref, model, atol=atol, rtol=rtol)
    assert_params_match(ref, model, atol=atol, rtol=rtol)
    return losses
