"""Prefetching: explicit forward/backward prefetch lists, implicit backward prefetch, unshard().

Prefetching only moves all-gathers earlier, so training must match the unsharded
reference exactly as without it; the recorded schedule shows when each all-gather
was issued relative to the neighbouring block's reshard and reduce-scatter.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2
from tests._dist import run_on_ranks
from tests._models import Transformer, lm_loss, make_batch
from tests._parity import average_grads, full, train_parity

N_LAYERS = 3


def _shard(model: Transformer, *, explicit: bool = False, implicit: bool = True) -> Transformer:
    for block in model.layers:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    model.set_implicit_prefetch(implicit)
    if explicit:
        layers = list(model.layers)
        for prev, nxt in zip(layers, layers[1:]):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])
    return model


def _one_step_schedule(model: Transformer) -> tuple[list[str], list[str]]:
    inputs, targets = make_batch(dist.get_rank(), 0)
    with fsdp2.record_schedule() as fwd:
        loss = lm_loss(model(inputs), targets)
    with fsdp2.record_schedule() as bwd:
        loss.backward()
    return list(fwd), list(bwd)


def _parity_and_schedule(explicit: bool, implicit: bool = True) -> tuple[list[str], list[str]]:
    models: list[Transformer] = []
    train_parity(Transformer, lambda m: models.append(_shard(m, explicit=explicit, implicit=implicit)))
    return _one_step_schedule(models[0])


def test_explicit_prefetch_matches_reference_and_gathers_ahead():
    for fwd, bwd in run_on_ranks(_parity_and_schedule, 2, True):
        for i in range(N_LAYERS):
            assert fwd.count(f"unshard layers.{i}") == 1, fwd  # a prefetched block is not gathered again
            assert bwd.count(f"unshard layers.{i}") == 1, bwd
        for i in range(N_LAYERS - 1):
            # Forward: block i+1's all-gather is issued while block i still holds its parameters.
            assert fwd.index(f"unshard layers.{i + 1}") < fwd.index(f"reshard layers.{i}"), fwd
        for i in range(1, N_LAYERS):
            # Backward: block i-1's all-gather is issued before block i reduces and reshards.
            assert bwd.index(f"unshard layers.{i - 1}") < bwd.index(f"reduce_scatter layers.{i}"), bwd
            assert bwd.index(f"unshard layers.{i - 1}") < bwd.index(f"reshard layers.{i}"), bwd


def test_implicit_forward_prefetch_gathers_next_block_ahead():
    # After the first iteration, each group issues the next group's all-gather (in last
    # iteration's order) before computing: root -> layers.0 -> layers.1 -> layers.2.
    for fwd, _bwd in run_on_ranks(_parity_and_schedule, 2, False):
        assert fwd.index("unshard layers.0") < fwd.index("unshard layers.1"), fwd
        for i in range(N_LAYERS - 1):
            assert fwd.count(f"unshard layers.{i}") == 1, fwd
            assert fwd.index(f"unshard layers.{i + 1}") < fwd.index(f"reshard layers.{i}"), fwd


def test_without_implicit_prefetch_each_block_gathers_after_previous_reshard():
    # The contrast: set_implicit_prefetch(False) gathers each group only when it is reached.
    for fwd, bwd in run_on_ranks(_parity_and_schedule, 2, False, False):
        for i in range(N_LAYERS - 1):
            assert fwd.index(f"reshard layers.{i}") < fwd.index(f"unshard layers.{i + 1}"), fwd
        for i in range(1, N_LAYERS):
            assert bwd.index(f"reshard layers.{i}") < bwd.index(f"unshard layers.{i - 1}"), bwd


def test_implicit_backward_prefetch_gathers_previous_block_before_reducing():
    for _fwd, bwd in run_on_ranks(_parity_and_schedule, 2, False):
        # Backward reaches layers.2 first; while it computes, layers.1 is already gathering,
        # and so on down the stack.
        assert bwd[:2] == ["unshard layers.2", "unshard layers.1"], bwd
        for i in range(1, N_LAYERS):
            assert bwd.index(f"unshard layers.{i - 1}") < bwd.index(f"reduce_scatter layers.{i}"), bwd
            assert bwd.count(f"unshard layers.{i - 1}") == 1, bwd


def _custom_backward_prefetch() -> tuple[list[str], list[str]]:
    models: list[Transformer] = []

    def shard(m: Transformer) -> None:
        models.append(_shard(m))
        m.layers[2].set_modules_to_backward_prefetch([m.layers[1], m.layers[0]])  # two ahead
        m.layers[1].set_modules_to_backward_prefetch([])  # empty: back to the implicit choice

    train_parity(Transformer, shard)
    return _one_step_schedule(models[0])


def test_explicit_backward_prefetch_list_replaces_implicit_choice():
    for _fwd, bwd in run_on_ranks(_custom_backward_prefetch, 2):
        # layers.2 asked for layers.1 and layers.0: both gathers go out before it reduces.
        assert bwd[:3] == ["unshard layers.2", "unshard layers.1", "unshard layers.0"], bwd
        assert bwd.index("unshard layers.0") < bwd.index("reduce_scatter layers.2"), bwd
        for i in range(N_LAYERS):
            assert bwd.count(f"unshard layers.{i}") == 1, bwd


def _empty_backward_prefetch_list() -> list[str]:
    model = _shard(Transformer())
    model.layers[2].set_modules_to_backward_prefetch([])
    _fwd, bwd = _one_step_schedule(model)
    return bwd


def test_empty_backward_prefetch_list_means_implicit_prefetch():
    # As in torch (an empty list falls back to the default): layers.1 is still prefetched.
    for bwd in run_on_ranks(_empty_backward_prefetch_list, 2):
        assert bwd.index("unshard layers.1") < bwd.index("reduce_scatter layers.2"), bwd


def _step(ref: nn.Module, model: Transformer, step: int, before_forward=None) -> list[str]:
    """One training step of both models; asserts loss and gradients match; returns the forward schedule."""
    inputs, targets = make_batch(dist.get_rank(), step)
    ref_loss = lm_loss(ref(inputs), targets)
    ref_loss.backward()
    average_grads(ref)
    with fsdp2.record_schedule() as fwd:
        if before_forward is not None:
            before_forward()
        loss = lm_loss(model(inputs), targets)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(full(p.grad), p_ref.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    ref.zero_grad()
    model.zero_grad()
    return list(fwd)


def _unshard_async_then_forward() -> dict:
    ref = Transformer()
    model = _shard(copy.deepcopy(ref))
    handles = []
    # Before the very first forward (lazy init not yet run through the root) ...
    _step(ref, model, 0, lambda: handles.append(model.layers[0].unshard(async_op=True)))
    # ... and in steady state; wait() is never called: the forward waits for the handle.
    fwd = _step(ref, model, 1, lambda: handles.append(model.layers[0].unshard(async_op=True)))
    return {"handles": [type(h).__name__ for h in handles],
            "handle_is_public_type": all(isinstance(h, fsdp2.UnshardHandle) for h in handles),
            "fwd": fwd}


def test_async_unshard_handle_wait_is_optional():
    for out in run_on_ranks(_unshard_async_then_forward, 2):
        assert out["handle_is_public_type"], out["handles"]
        fwd = out["fwd"]
        # The early all-gather is the one forward uses: layers.0 is gathered once, first.
        assert fwd[0] == "unshard layers.0", fwd
        assert fwd.count("unshard layers.0") == 1, fwd


def _explicit_unshard_reshard() -> dict:
    ref = Transformer()
    model = _shard(copy.deepcopy(ref))
    block = model.layers[0]
    sharded = dict(block.named_parameters())
    expected = {name: p.full_tensor() for name, p in sharded.items()}
    out: dict = {"sharded_types": sorted({type(p).__name__ for p in sharded.values()})}

    out["sync_returns"] = repr(block.unshard())
    held = dict(block.named_parameters())
    out["unsharded_types"] = sorted({type(p).__name__ for p in held.values()})
    for name, p in held.items():
        assert p.shape == expected[name].shape and torch.equal(p.detach(), expected[name]), name
    # Not recursive: the other blocks and the root still hold their shards.
    out["others_types"] = sorted({type(p).__name__ for p in model.layers[1].parameters()}
                                 | {type(model.tok_emb.weight).__name__})

    block.reshard()
    back = dict(block.named_parameters())
    out["resharded_same_objects"] = all(back[name] is p for name, p in sharded.items())

    handle = block.unshard(async_op=True)
    handle.wait()
    out["after_wait_types"] = sorted({type(p).__name__ for p in block.parameters()})
    block.reshard()
    # Training after all this still matches the reference.
    _step(ref, model, 0)
    return out


def test_sync_unshard_holds_full_params_and_reshard_restores_dtensors():
    for out in run_on_ranks(_explicit_unshard_reshard, 2):
        assert out["sharded_types"] == ["DTensor"]
        assert out["sync_returns"] == "None"
        assert out["unsharded_types"] == ["Parameter"]
        assert out["others_types"] == ["DTensor"]
        assert out["resharded_same_objects"]
        assert out["after_wait_types"] == ["Parameter"]


def _peak_blocks_gathered(events: list[str]) -> int:
    live: set[str] = set()
    peak = 0
    for event in events:
        kind, label = event.split(" ", 1)
        if kind == "unshard":
            live.add(label)
        elif kind == "reshard":
            live.discard(label)
        peak = max(peak, len(live - {"root"}))
    return peak


def _two_ahead_with_limit(limit: int | None) -> int:
    """Explicit lists ask for two blocks ahead in both directions; returns the peak gathered."""
    models: list[Transformer] = []

    def shard(m: Transformer) -> None:
        models.append(_shard(m))
        layers = list(m.layers)
        for i, block in enumerate(layers):
            block.set_modules_to_forward_prefetch(layers[i + 1:i + 3])
            block.set_modules_to_backward_prefetch(layers[max(0, i - 2):i][::-1])
        if limit is not None:
            m.set_prefetch_limit(limit)

    train_parity(Transformer, shard)  # the cap only delays gathers: training is unchanged
    fwd, bwd = _one_step_schedule(models[0])
    return _peak_blocks_gathered(fwd + bwd)


def test_prefetch_limit_caps_blocks_gathered_ahead():
    peaks = {limit: run_on_ranks(_two_ahead_with_limit, 2, limit) for limit in (None, 1, 0)}
    # No cap: the block computing plus the two asked for; a cap of 1: plus one; 0: alone.
    assert peaks == {None: [3, 3], 1: [2, 2], 0: [1, 1]}


def _bad_prefetch_limit(limit) -> str:
    model = _shard(Transformer())
    try:
        model.set_prefetch_limit(limit)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("limit", [-1, 1.5, True])
def test_prefetch_limit_rejects_bad_values(limit):
    for message in run_on_ranks(_bad_prefetch_limit, 2, limit):
        assert message == f"set_prefetch_limit: limit must be None or an int >= 0, got {limit!r}"
