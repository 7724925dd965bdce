"""Gradient accumulation over micro-batches: no-sync backwards, is_last_backward, keeping params.

Every step runs two micro-batches. The unsharded reference sums both micro-batches'
gradients and then averages them across ranks; FSDP must end up with exactly that
gradient however it is told to defer communication.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp2
from tests._dist import run_on_ranks
from tests._models import Transformer, lm_loss, make_batch
from tests._parity import assert_params_match, average_grads

MICRO = 2
GROUPS = ["layers.2", "layers.1", "layers.0", "root"]


def _shard(model: Transformer, fully_shard: Any = fsdp2.fully_shard, **kwargs: Any) -> Transformer:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _configure(model: Any, mode: str, last: bool) -> None:
    """Set the accumulation knobs for one micro-batch (``last``: the one that syncs)."""
    if mode in ("no_sync", "keep_unsharded"):
        model.set_requires_gradient_sync(last)
    if mode == "keep_unsharded":
        model.set_reshard_after_backward(last)
    if mode == "is_last_backward":
        model.set_is_last_backward(last)


def _accumulate_vs_reference(mode: str, steps: int = 2) -> list[dict]:
    """Train with ``MICRO`` micro-batches per step against the unsharded reference.

    Returns, per micro-batch, the forward and backward schedules and what the module
    held after backward.
    """
    rank = dist.get_rank()
    ref = Transformer()
    model = _shard(copy.deepcopy(ref))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    record = []
    for step in range(steps):
        for micro in range(MICRO):
            last = micro == MICRO - 1
            inputs, targets = make_batch(rank, MICRO * step + micro)
            ref_loss = lm_loss(ref(inputs), targets)
            ref_loss.backward()  # accumulates into .grad across micro-batches
            _configure(model, mode, last)
            with fsdp2.record_schedule() as fwd:
                loss = lm_loss(model(inputs), targets)
            with fsdp2.record_schedule() as bwd:
                loss.backward()
            torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
            record.append({
                "fwd": list(fwd), "bwd": list(bwd),
                "module_params": sorted({type(p).__name__ for p in model.parameters()}),
                "sharded_grads": sorted({type(p.grad).__name__ for p in opt.param_groups[0]["params"]}),
            })
        average_grads(ref)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        assert_params_match(ref, model)
    return record


def _reduced(events: list[str]) -> list[str]:
    return [e.split(" ", 1)[1] for e in events if e.startswith("reduce_scatter ")]


def _gathered(events: list[str]) -> list[str]:
    return [e.split(" ", 1)[1] for e in events if e.startswith("unshard ")]


def test_no_sync_micro_batch_matches_reference_and_does_not_reduce():
    for record in run_on_ranks(_accumulate_vs_reference, 2, "no_sync"):
        for micro, r in enumerate(record):
            if micro % MICRO == 0:
                assert _reduced(r["bwd"]) == [], r["bwd"]
                assert r["sharded_grads"] == ["NoneType"]  # nothing reduced yet
            else:
                assert sorted(_reduced(r["bwd"])) == sorted(GROUPS), r["bwd"]
                assert r["sharded_grads"] == ["DTensor"]
            assert r["module_params"] == ["DTensor"]  # resharded after every backward


def test_is_last_backward_false_then_true_matches_reference():
    # Both micro-batches reduce; the first one's end of backward need not wait for them.
    for record in run_on_ranks(_accumulate_vs_reference, 2, "is_last_backward"):
        for r in record:
            assert sorted(_reduced(r["bwd"])) == sorted(GROUPS), r["bwd"]
        for r in record[MICRO - 1::MICRO]:
            assert r["sharded_grads"] == ["DTensor"]  # the last backward waited for every reduction


def test_reshard_after_backward_false_keeps_params_for_next_forward():
    for record in run_on_ranks(_accumulate_vs_reference, 2, "keep_unsharded"):
        for micro, r in enumerate(record):
            if micro % MICRO == 0:
                # Kept unsharded: the module holds plain full parameters, no DTensors.
                assert r["module_params"] == ["Parameter"]
                assert _reduced(r["bwd"]) == []
                assert sorted(set(_gathered(r["fwd"]))) == sorted(GROUPS), r["fwd"]
            else:
                assert _gathered(r["fwd"]) == [], r["fwd"]  # nothing to gather again
                assert r["module_params"] == ["DTensor"]
                assert sorted(_reduced(r["bwd"])) == sorted(GROUPS), r["bwd"]


def _accumulate_vs_torch(steps: int = 2) -> list[list[str]]:
    """bf16 params, fp32 reduction, no-sync accumulation: fsdp2 and torch side by side."""
    rank = dist.get_rank()
    base = Transformer()
    mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = _shard(copy.deepcopy(base), mp_policy=fsdp2.MixedPrecisionPolicy(**mp))
    theirs = _shard(copy.deepcopy(base), torch_fully_shard, mp_policy=TorchPolicy(**mp))
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    no_sync_bwd = []
    for step in range(steps):
        for micro in range(MICRO):
            last = micro == MICRO - 1
            inputs, targets = make_batch(rank, MICRO * step + micro)
            ours.set_requires_gradient_sync(last)
            theirs.set_requires_gradient_sync(last)
            loss, ref_loss = lm_loss(ours(inputs), targets), lm_loss(theirs(inputs), targets)
            with fsdp2.record_schedule() as bwd:
                loss.backward()
            ref_loss.backward()
            assert torch.equal(loss, ref_loss), (step, micro, loss, ref_loss)
            if not last:
                no_sync_bwd.append(list(bwd))
        for (name, p), p_ref in zip(ours.named_parameters(), theirs.parameters()):
            assert p.grad.dtype == torch.float32 and isinstance(p.grad, DTensor), name
            assert torch.equal(p.grad.full_tensor(), p_ref.grad.full_tensor()), name
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        for (name, p), p_ref in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(p.full_tensor(), p_ref.full_tensor()), name
    return no_sync_bwd


def test_no_sync_with_bf16_params_fp32_reduce_matches_torch():
    # Same casts as torch (bf16 micro-batch gradients summed in fp32, then reduced in
    # fp32), so the match is exact.
    for no_sync_bwd in run_on_ranks(_accumulate_vs_torch, 2):
        assert all(_reduced(events) == [] for events in no_sync_bwd), no_sync_bwd
