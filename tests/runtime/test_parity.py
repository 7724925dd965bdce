"""Parity: a fully_shard-ed model trains exactly like the unsharded data-parallel reference.

Each test trains the sharded model and a plain copy whose gradients are all-reduce-averaged
(tests/_parity.py) with AdamW on different data per rank, and compares losses and every
parameter's full tensor; tests that exercise a schedule also pin the collectives issued.
"""

from __future__ import annotations

import collections
import copy

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fsdp2
from fsdp2 import fully_shard, record_schedule
from tests._dist import run_on_ranks
from tests._models import MLP, Transformer, lm_loss, make_batch
from tests._parity import assert_params_match, train_parity


# ---- shared helpers (run on the ranks) ----------------------------------------------------
def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _shard_blocks_then_root(model: nn.Module, **kwargs) -> nn.Module:
    mesh = _mesh()
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def _dense_batch(dim_in: int, dim_out: int):
    def batch(rank: int, step: int):
        g = torch.Generator().manual_seed(1_000_003 * step + rank)
        return torch.randn(4, dim_in, generator=g), torch.randn(4, dim_out, generator=g)
    return batch


class _Captured:
    """Remembers the reference (built first) and the sharded copy that train_parity makes."""

    def __init__(self, build, shard) -> None:
        self._build, self._shard = build, shard
        self.ref: nn.Module | None = None
        self.model: nn.Module | None = None

    def build(self) -> nn.Module:
        self.ref = self._build()
        return self.ref

    def shard(self, model: nn.Module) -> nn.Module:
        self.model = model
        return self._shard(model)


def _counts(events: list[str]) -> dict[str, int]:
    """How many events of each kind ("unshard", "reshard", "reduce_scatter", ...)."""
    return dict(collections.Counter(e.split(" ", 1)[0] for e in events))


def _step_events(model: nn.Module, step: int = 0) -> tuple[list[str], list[str]]:
    """One forward and one backward on this rank's batch: (forward events, backward events)."""
    x, y = make_batch(dist.get_rank(), step)
    with record_schedule() as forward:
        loss = lm_loss(model(x), y)
    with record_schedule() as backward:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return forward, backward


# ---- 1. default arguments -----------------------------------------------------------------
def _transformer_bottom_up():
    return train_parity(Transformer, _shard_blocks_then_root)


def test_transformer_blocks_then_root_matches_reference():
    losses = run_on_ranks(_transformer_bottom_up, 2)
    assert losses[0] != losses[1]  # each rank trained on its own data


def _mlp_root_only():
    return train_parity(lambda: MLP(8, 16), lambda m: fully_shard(m, mesh=_mesh()),
                        batch=_dense_batch(8, 8), loss_fn=F.mse_loss)


def test_mlp_root_only_matches_reference():
    run_on_ranks(_mlp_root_only, 2)


# ---- 2. reshard_after_forward -------------------------------------------------------------
def _reshard_after_forward(value, tolerance=1e-5):
    events: list[tuple[list[str], list[str]]] = []

    def shard(model):
        _shard_blocks_then_root(model, reshard_after_forward=value)
        events.append(_step_events(model))

    train_parity(Transformer, shard, atol=tolerance, rtol=tolerance)
    return events[0]


@pytest.mark.parametrize("value", [True, False, None])
def test_reshard_after_forward_bool_or_none_matches_reference(value):
    forward, backward = run_on_ranks(_reshard_after_forward, 2, value)[0]
    # None means "False for the root, True for the others".
    blocks_free = value is not False
    root_frees = value is True
    assert ("reshard layers.0" in forward) == blocks_free, forward
    assert ("reshard root" in forward) == root_frees, forward
    # What forward freed, backward gathers again; what it kept, backward reuses.
    assert _counts(backward).get("unshard", 0) == 3 * blocks_free + root_frees, backward
    assert _counts(backward)["reduce_scatter"] == 4, backward


def test_reshard_after_forward_int_reshards_to_subgroup_and_matches_reference():
    # Four ranks: the reference's all-reduce and fsdp2's reduce-scatter add the four
    # gradients in different orders (a few ulps apart, which AdamW's normalisation of
    # near-zero gradients magnifies to ~1e-5); two ranks add in the same order.
    forward, backward = run_on_ranks(_reshard_after_forward, 4, 2, 1e-4)[0]
    # Every group keeps 1/2 of its parameters after forward (pairs of ranks) ...
    assert sorted(e for e in forward if e.startswith("reshard")) == [
        "reshard_partial layers.0", "reshard_partial layers.1", "reshard_partial layers.2",
        "reshard_partial root",
    ], forward
    # ... and backward gathers each one again within its pair, then frees it fully.
    assert _counts(backward) == {"unshard": 4, "reduce_scatter": 4, "reshard": 4}, backward


# ---- 3. uneven dim 0 ----------------------------------------------------------------------
def _seven_five_three_one():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 1))


def _uneven():
    """Train with every dim 0 uneven; return this rank's local shard shapes."""
    init = dict(_seven_five_three_one().named_parameters())
    sizes = {}

    def shard(model):
        mesh = _mesh()
        fully_shard(model, mesh=mesh)
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.shape == init[name].shape, (name, p.shape)
            # DTensor's own split of the full tensor is the reference for this rank's shard.
            expected = distribute_tensor(init[name].detach(), mesh, [Shard(0)]).to_local()
            torch.testing.assert_close(p.to_local(), expected, rtol=0, atol=0)
            sizes[name] = tuple(p.to_local().shape)

    train_parity(_seven_five_three_one, shard, batch=_dense_batch(7, 1), loss_fn=F.mse_loss)
    return sizes


def test_uneven_dim0_matches_reference():
    sizes = run_on_ranks(_uneven, 2)
    # Linear(7, 5).weight is (5, 7): chunks of ceil(5 / 2) = 3 rows, the last one short.
    assert [s["0.weight"] for s in sizes] == [(3, 7), (2, 7)]
    assert [s["2.bias"] for s in sizes] == [(2,), (1,)]


def test_dim0_smaller_than_world_leaves_empty_shards():
    sizes = run_on_ranks(_uneven, 4)
    # Linear(3, 1).weight is (1, 3): rank 0 holds the one row, ranks 1-3 hold nothing.
    assert [s["4.weight"] for s in sizes] == [(1, 3), (0, 3), (0, 3), (0, 3)]
    assert [s["0.weight"] for s in sizes] == [(2, 7), (2, 7), (1, 7), (0, 7)]


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    # channels_last: the conv weights are non-contiguous parameters (torch's fully_shard refuses
    # them with NotImplementedError; fsdp2 shards their values, docs/comparison.md).
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    model.to(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    return model


def _image_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 2, generator=g)


def _non_contiguous():
    def shard(model):
        fully_shard(model[0], mesh=_mesh())
        fully_shard(model, mesh=_mesh())

    cap = _Captured(_conv_net, shard)
    losses = train_parity(cap.build, cap.shard, batch=_image_batch, loss_fn=F.mse_loss)
    return losses, tuple(cap.model[0].weight.to_local().shape)


def test_non_contiguous_parameters_are_sharded_by_value_and_match_reference():
    (losses, shard_shape), _ = run_on_ranks(_non_contiguous, 2)
    assert shard_shape == (4, 3, 3, 3) and len(losses) == 3


# ---- 4. shard_placement_fn ----------------------------------------------------------------
def _shard_dim1(param):
    return Shard(1) if param.ndim == 2 else None


def _placement(build, batch, loss_fn):
    placements = {}

    def shard(model):
        if hasattr(model, "layers"):
            _shard_blocks_then_root(model, shard_placement_fn=_shard_dim1)
        else:
            fully_shard(model, mesh=_mesh(), shard_placement_fn=_shard_dim1)
        for name, p in model.named_parameters():
            placements[name] = (tuple(p.placements), tuple(p.to_local().shape))

    train_parity(build, shard, batch=batch, loss_fn=loss_fn)
    return placements


def _placement_even():
    return _placement(Transformer, make_batch, lm_loss)


def _placement_uneven():
    return _placement(_seven_five_three_one, _dense_batch(7, 1), F.mse_loss)


def test_shard_placement_fn_dim1_even_matches_reference():
    by_rank = run_on_ranks(_placement_even, 2)
    placements = by_rank[0]
    assert placements["tok_emb.weight"] == ((Shard(1),), (64, 16))
    assert placements["layers.0.qkv.weight"] == ((Shard(1),), (96, 16))
    assert placements["layers.0.attn_norm.weight"] == ((Shard(0),), (16,))


def test_shard_placement_fn_dim1_uneven_matches_reference():
    by_rank = run_on_ranks(_placement_uneven, 2)
    # Linear(7, 5).weight is (5, 7): split along dim 1 into 4 + 3 columns.
    assert [r["0.weight"] for r in by_rank] == [((Shard(1),), (5, 4)), ((Shard(1),), (5, 3))]
    assert [r["2.weight"] for r in by_rank] == [((Shard(1),), (3, 3)), ((Shard(1),), (3, 2))]
    assert [r["2.bias"] for r in by_rank] == [((Shard(0),), (2,)), ((Shard(0),), (1,))]


# ---- 5. frozen parameters -----------------------------------------------------------------
def _build_partly_frozen():
    model = Transformer()
    model.tok_emb.weight.requires_grad_(False)  # one frozen param in the (trainable) root group
    model.layers[1].requires_grad_(False)  # a whole group frozen
    return model


def _frozen():
    cap = _Captured(_build_partly_frozen, _shard_blocks_then_root)
    initial = {n: p.detach().clone() for n, p in _build_partly_frozen().named_parameters()
               if not p.requires_grad}
    train_parity(cap.build, cap.shard)
    x, y = make_batch(dist.get_rank(), 9)
    lm_loss(cap.model(x), y).backward()
    frozen = 0
    for name, p in cap.model.named_parameters():
        assert isinstance(p, DTensor), name
        if name in initial:
            frozen += 1
            assert not p.requires_grad and p.grad is None, name
            torch.testing.assert_close(p.full_tensor(), initial[name], rtol=0, atol=0)
        else:
            assert p.requires_grad and isinstance(p.grad, DTensor), name
    return frozen


def test_frozen_parameters_stay_frozen_and_the_rest_matches_reference():
    frozen = run_on_ranks(_frozen, 2)
    assert frozen == [1 + len(list(Transformer().layers[1].parameters()))] * 2


# ---- 6. tied parameters -------------------------------------------------------------------
def _build_tied():
    model = Transformer()
    model.output.weight = model.tok_emb.weight
    return model


def _tied():
    cap = _Captured(_build_tied, _shard_blocks_then_root)
    train_parity(cap.build, cap.shard)
    model = cap.model
    inside = []
    handle = model.output.register_forward_pre_hook(
        lambda m, _args: inside.append((m.weight is model.tok_emb.weight, isinstance(m.weight, DTensor))))
    x, y = make_batch(dist.get_rank(), 5)
    lm_loss(model(x), y).backward()
    handle.remove()
    assert inside == [(True, False)], inside  # one unsharded Parameter serving both modules
    assert model.output.weight is model.tok_emb.weight
    assert isinstance(model.output.weight, DTensor)
    return True


def test_tied_parameters_stay_tied_and_match_reference():
    assert run_on_ranks(_tied, 2) == [True, True]


# ---- 7. buffers ---------------------------------------------------------------------------
def _build_batchnorm():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _batchnorm():
    cap = _Captured(_build_batchnorm, lambda m: fully_shard(m, mesh=_mesh()))
    train_parity(cap.build, cap.shard, batch=_dense_batch(8, 4), loss_fn=F.mse_loss)
    ref_buffers = dict(cap.ref.named_buffers())
    buffers = dict(cap.model.named_buffers())
    assert buffers.keys() == ref_buffers.keys() and buffers, buffers.keys()
    for name, buf in buffers.items():
        assert type(buf) is torch.Tensor, (name, type(buf))
        torch.testing.assert_close(buf, ref_buffers[name], atol=1e-5, rtol=1e-5)
    assert buffers["1.num_batches_tracked"].item() == 3
    return buffers["1.running_mean"].tolist()


def test_batchnorm_buffers_stay_local_and_track_like_reference():
    means = run_on_ranks(_batchnorm, 2)
    assert means[0] != means[1]  # per-rank statistics: never synchronized


# ---- 8. ignored_params --------------------------------------------------------------------
def _ignored():
    rank = dist.get_rank()
    ref = Transformer()
    model = copy.deepcopy(ref)
    ignored = {model.pos_emb.weight, model.layers[0].proj.weight}
    ignored_names = {"pos_emb.weight", "layers.0.proj.weight"}
    _shard_blocks_then_root(model, ignored_params=ignored)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_params = dict(ref.named_parameters())
    for step in range(3):
        x, y = make_batch(rank, step)
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        world = dist.get_world_size()
        for name, p in ref_params.items():
            if name not in ignored_names:  # ignored parameters keep their local gradient
                dist.all_reduce(p.grad)
                p.grad /= world
        loss = lm_loss(model(x), y)
        loss.backward()
        for name, p in model.named_parameters():
            if name in ignored_names:
                assert type(p) is nn.Parameter and not isinstance(p, DTensor), name
                assert type(p.grad) is torch.Tensor, name
                torch.testing.assert_close(p.grad, ref_params[name].grad, atol=1e-5, rtol=1e-5)
            else:
                assert isinstance(p, DTensor), name
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert_params_match(ref, model)
    return model.pos_emb.weight.detach().sum().item()


def test_ignored_params_stay_local_and_unreduced():
    sums = run_on_ranks(_ignored, 2)
    assert sums[0] != sums[1]  # each rank stepped its ignored copy on its own gradient


# ---- 9. several modules in one group ------------------------------------------------------
def _module_list_group():
    events: list[list[str]] = []

    def shard(model):
        mesh = _mesh()
        fully_shard([model.layers[0], model.layers[1]], mesh=mesh)
        fully_shard(model.layers[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        forward, backward = _step_events(model)
        events.append(forward + ["-- backward --"] + backward)

    train_parity(Transformer, shard)
    return events[0]


def test_list_of_modules_is_one_group():
    events = run_on_ranks(_module_list_group, 2)[0]
    expecttest.assert_expected_inline("\n".join(events), """\
unshard root
unshard layers.0,layers.1
reshard layers.0,layers.1
unshard layers.2
reshard layers.2
-- backward --
unshard layers.2
unshard layers.0,layers.1
reshard layers.2
reduce_scatter layers.2
reshard layers.0,layers.1
reduce_scatter layers.0,layers.1
reshard root
reduce_scatter root""")


# ---- 10. mixed dtypes in one group --------------------------------------------------------
class _LoRABlock(nn.Module):
    """An fp32 Linear plus a bf16 low-rank adapter: one group holding two dtypes."""

    def __init__(self, dim: int = 16, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.lora_a = nn.Linear(dim, rank, bias=False).to(torch.bfloat16)
        self.lora_b = nn.Linear(rank, dim, bias=False).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, dim) fp32
        return torch.tanh(self.base(x) + self.lora_b(self.lora_a(x.bfloat16())).float())


def _build_lora():
    torch.manual_seed(7)
    return nn.Sequential(_LoRABlock(), _LoRABlock(), nn.Linear(16, 2))


def _mixed_dtypes():
    def shard(model):
        mesh = _mesh()
        for block in model[:2]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    cap = _Captured(_build_lora, shard)
    train_parity(cap.build, cap.shard, batch=_dense_batch(16, 2), loss_fn=F.mse_loss,
                 atol=1e-2, rtol=1e-2)
    ref_params = dict(cap.ref.named_parameters())
    dtypes = {}
    for name, p in cap.model.named_parameters():
        tol = 1e-5 if p.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(p.full_tensor(), ref_params[name].detach(), atol=tol, rtol=tol,
                                   msg=lambda m: f"{name}: {m}")
        dtypes[name] = str(p.dtype)
    x, _ = _dense_batch(16, 2)(dist.get_rank(), 0)
    with record_schedule() as forward:
        out = cap.model(x)
    out.sum().backward()
    return dtypes, forward


def test_mixed_dtypes_in_one_group_gather_once():
    dtypes, forward = run_on_ranks(_mixed_dtypes, 2)[0]
    assert dtypes["0.base.weight"] == "torch.float32" and dtypes["0.lora_a.weight"] == "torch.bfloat16"
    assert [e for e in forward if e.startswith("unshard")] == ["unshard root", "unshard 0", "unshard 1"]


# ---- 11. collectives per step -------------------------------------------------------------
def _collectives_per_step():
    per_step = []

    def shard(model):
        _shard_blocks_then_root(model)
        per_step.extend(_step_events(model, step) for step in range(2))

    train_parity(Transformer, shard)
    return per_step


def test_collectives_per_training_step():
    per_step = run_on_ranks(_collectives_per_step, 2)[0]
    for forward, backward in per_step:
        # Forward gathers the root and the 3 blocks; the root keeps its parameters to the end of
        # backward (as torch's FSDP2), so backward gathers only the 3 blocks again. One
        # reduce-scatter per group, the root's at the end.
        assert _counts(forward) == {"unshard": 4, "reshard": 3}, forward
        assert _counts(backward) == {"unshard": 3, "reduce_scatter": 4, "reshard": 4}, backward


# ---- world size 1 ------------------------------------------------------------------------
def _world_size_one_matches_plain_training() -> list[float]:
    # A mesh of one rank per process (the "b" axis of a (2, 1) mesh): no communication at
    # all, so each rank trains exactly like the plain model on its own data.
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("a", "b"))["b"]
    ref = Transformer()
    model = copy.deepcopy(ref)
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        inputs, targets = make_batch(dist.get_rank(), step)
        for m, o in ((ref, ref_opt), (model, opt)):
            loss = lm_loss(m(inputs), targets)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
    assert_params_match(ref, model, atol=1e-6, rtol=1e-6)
    return losses


def test_world_size_one_matches_plain_training():
    for losses in run_on_ranks(_world_size_one_matches_plain_training, 2):
        assert losses[0::2] == pytest.approx(losses[1::2], abs=1e-6)
