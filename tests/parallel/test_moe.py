"""Mixture of experts with expert parallelism: experts on their own meshes, as torchtitan lays them out.

Dense parts (embedding, mixing layers, router, shared expert, head) are sharded on the full
data-parallel mesh; the experts (``tests/_moe.py``: one ``(experts, dim, hidden)`` parameter,
``Shard(0)`` on the ``ep`` axis, tokens dispatched by ``all_to_all_single``) in a ``fully_shard``
call of their own on the ``efsdp`` mesh, on dim 0, or on dim 1 when there are fewer experts
than ``efsdp x ep`` shards (torchtitan's rule); or, as torchtitan 0.3's ``apply_fsdp`` does, in
the block's one call, by a ``shard_placement_fn`` returning torch's ``ShardPlacementResult``
(one parameter group per mesh; also through torchtitan's own function under ``patch_torch()``).
The meshes come from torchtitan's own ``ParallelDims`` (``DeviceMesh._unflatten`` of a 1-D world
mesh) or from ``init_device_mesh`` (the dense mesh ``_flatten``-ed from the sparse one). fsdp2
and torch's ``fully_shard`` train the same model side by side, with torchtitan's gradient
scaling (divide factor 1, the loss scaled): losses, gradients, layouts and parameters must be
equal (``torch.equal``); fsdp2's must match an unsharded model trained on every rank's batch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.util
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fsdp2
from tests._dist import run_on_ranks
from tests._moe import MoEModel, batch, expert_parallel, loss_of, torchtitan_names

# torchtitan (the integration extra) builds the meshes where installed; init_device_mesh always.
HAS_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
TORCHTITAN = pytest.param("torchtitan", marks=pytest.mark.skipif(not HAS_TORCHTITAN, reason="needs torchtitan"))
# torch 2.13 added ShardPlacementResult (a mesh per parameter) to its FSDP2.
HAS_SHARD_PLACEMENT_RESULT = hasattr(importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_common"),
                                     "ShardPlacementResult")


@functools.cache
def _meshes(kind: str, ep: int) -> tuple[DeviceMesh, DeviceMesh | None, DeviceMesh | None]:
    """(dense data-parallel mesh, experts' efsdp mesh, ep mesh); the last two None without EP.

    Made once per rank process (every rank asks for the same meshes in the same order): the tests
    reuse the process groups instead of adding gloo threads to the pool's workers with each run."""
    world = dist.get_world_size()
    if kind.startswith("torchtitan"):
        # ParallelDims gives its size-1 axes torch's "fake" backend (registered by this import).
        import torch.testing._internal.distributed.fake_pg  # noqa: F401
        import torchtitan.distributed.parallel_dims as parallel_dims
        parallel_dims.device_type = "cpu"  # it builds its world mesh on the accelerator it found
        replicas = 2 if kind == "torchtitan-hsdp" else 1
        dims = parallel_dims.ParallelDims(dp_replicate=replicas, dp_shard=world // replicas, cp=1, tp=1, pp=1,
                                          ep=ep, world_size=world, spmd_backend="partial_dtensor")
        dims.build_mesh()
        if replicas > 1:  # HSDP: torchtitan's (dp_replicate, fsdp) and (dp_replicate, efsdp) meshes
            return (dims.get_mesh(["dp_replicate", "fsdp"]), dims.get_mesh(["dp_replicate", "efsdp"]),
                    dims.get_mesh("ep"))
        return dims.get_mesh("fsdp"), dims.get_optional_mesh("efsdp"), dims.get_optional_mesh("ep")
    sparse = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    dense = sparse["efsdp", "ep"]._flatten("fsdp")
    if ep == 1:
        return dense, None, None
    return dense, sparse["efsdp"], sparse["ep"]


def _shard(model: MoEModel, fully_shard, dense: DeviceMesh, efsdp: DeviceMesh | None,
           ep: DeviceMesh | None) -> None:
    """torchtitan's MoE apply_fsdp, with the experts in their own fully_shard call."""
    for block in model.layers:
        experts = block.moe.experts
        shards = efsdp.size(efsdp.ndim - 1) * ep.size() if ep is not None else dense.size(dense.ndim - 1)
        placement = Shard(1) if shards > experts.num_experts else Shard(0)
        fully_shard(experts, mesh=efsdp if ep is not None else dense, shard_placement_fn=lambda _p, s=placement: s)
        fully_shard(block, mesh=dense)
    fully_shard(model, mesh=dense)
    _sum_gradients(model)


def _shard_one_call(model: MoEModel, fully_shard, dense: DeviceMesh, efsdp: DeviceMesh, ep: DeviceMesh) -> None:
    """torchtitan 0.3.0's MoE apply_fsdp with EP: each block in one fully_shard call, its
    experts on the efsdp mesh and the rest on the dense one by ShardPlacementResult (one
    parameter group per mesh)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    dense_info, experts_info = _get_mesh_info(dense), _get_mesh_info(efsdp)
    def placement_fn(p: nn.Parameter, experts: set, placement: Shard) -> ShardPlacementResult:
        if p in experts:
            return ShardPlacementResult(placement=placement, mesh_info=experts_info)
        return ShardPlacementResult(placement=Shard(0), mesh_info=dense_info)

    for block in model.layers:
        experts = block.moe.experts
        shards = efsdp.size(efsdp.ndim - 1) * ep.size()
        placement = Shard(1) if shards > experts.num_experts else Shard(0)
        fully_shard(block, mesh=dense, shard_placement_fn=functools.partial(
            placement_fn, experts=set(experts.parameters()), placement=placement))
    fully_shard(model, mesh=dense)
    _sum_gradients(model)


def _shard_with_torchtitan(model: MoEModel, fully_shard, dense: DeviceMesh, efsdp: DeviceMesh,
                           ep: DeviceMesh) -> None:
    """torchtitan's own apply_fsdp_to_decoder (EP: one call per block, a mesh per parameter, and
    its explicit prefetches); fsdp2 through patch_torch()."""
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    torchtitan_names(model)
    with fsdp2.patch_torch() if fully_shard is fsdp2.fully_shard else contextlib.nullcontext():
        apply_fsdp_to_decoder(model, dense, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False,
                              ep_degree=ep.size(), edp_mesh=efsdp)  # (it sets the divide factor 1 itself)
    _sum_gradients(model)


def _sum_gradients(model: MoEModel) -> None:
    # torchtitan's disable_fsdp_gradient_division: gradients are summed, the loss scaled instead
    # (the experts' sum runs over efsdp x ep tokens, the dense one over every rank's).
    for module in model.modules():
        if isinstance(module, (fsdp2.FSDPModule, TorchFSDPModule)):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # else torch wants PREMUL_SUM, which gloo lacks


def _layout(p: DTensor) -> tuple:
    return p.device_mesh.mesh_dim_names, tuple(p.placements), tuple(p.to_local().shape)


class _Run(NamedTuple):
    losses: list[list[float]]  # per step: fsdp2's, torch's
    reference_losses: list[float]  # per step: this rank's on the unsharded reference
    counts: list[list[dict]]  # per model, per step: the collectives CommDebugMode saw
    grads_equal: bool  # fsdp2's and torch's gradients, bit for bit, every step
    grad_vs_reference: float  # the largest difference of fsdp2's gradients from the reference's


def _train_pair(models: list[nn.Module], reference: nn.Module, steps: int) -> _Run:
    """AdamW steps of fsdp2's and torch's sharded models and the unsharded reference, which
    takes every rank's batch (each loss divided by the world: the ranks' sum is the mean)."""
    from torch.distributed.tensor.debug import CommDebugMode
    world, rank = dist.get_world_size(), dist.get_rank()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (*models, reference)]
    run = _Run([], [], [[] for _ in models], True, 0.0)
    for step in range(steps):
        step_losses = []
        for m, seen in zip(models, run.counts):
            with CommDebugMode() as mode:
                loss = loss_of(m, *batch(rank, step)) / world
                loss.backward()
            step_losses.append(loss.item())
            seen.append({str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items() if n})
        per_rank = [loss_of(reference, *batch(r, step)) / world for r in range(world)]
        sum(per_rank).backward()
        grads = [[p.grad.full_tensor() for p in m.parameters()] for m in models]
        run = run._replace(
            grads_equal=run.grads_equal and all(torch.equal(a, b) for a, b in zip(*grads)),
            grad_vs_reference=max(run.grad_vs_reference, *((g - r.grad).abs().max().item()
                                                           for g, r in zip(grads[0], reference.parameters()))))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        run.losses.append(step_losses)
        run.reference_losses.append(per_rank[rank].item())
    return run


def _train_vs_torch(kind: str, num_experts: int, ep: int, steps: int = 2, shard=_shard) -> dict:
    torch.manual_seed(0)
    base = MoEModel(num_experts)
    dense, efsdp, ep_mesh = _meshes(kind, ep)
    models = []
    for fully_shard in (fsdp2.fully_shard, torch_fully_shard):
        model = copy.deepcopy(base)
        if ep_mesh is not None:
            expert_parallel(model, ep_mesh)
        shard(model, fully_shard, dense, efsdp, ep_mesh)
        models.append(model)
    reference = copy.deepcopy(base)
    run = _train_pair(models, reference, steps)
    losses, reference_losses, counts = run.losses, run.reference_losses, run.counts
    grads_equal, grad_vs_reference = run.grads_equal, run.grad_vs_reference
    named = [dict(m.named_parameters()) for m in models]
    w1 = models[0].layers[0].moe.experts.w1
    return {
        "losses_equal": all(a == b for a, b in losses),
        "grads_equal": grads_equal,
        "layouts_equal": all(_layout(p) == _layout(named[1][n]) for n, p in named[0].items()),
        "params_equal": all(torch.equal(p.full_tensor(), named[1][n].full_tensor()) for n, p in named[0].items()),
        "loss_vs_reference": max(abs(a[0] - b) for a, b in zip(losses, reference_losses)),
        "grad_vs_reference": grad_vs_reference,
        "param_vs_reference": max((p.full_tensor() - r).abs().max().item()
                                  for (_n, p), r in zip(named[0].items(), reference.parameters())),
        "experts": _layout(w1),
        "grouped": isinstance(models[0].layers[0].moe.experts if shard is _shard else models[0].layers[0],
                              fsdp2.FSDPModule),
        "block_groups": len(fsdp2.fully_shard.state(models[0].layers[0])._fsdp_param_groups),
        "counts": counts[0],
        "counts_equal": counts[0] == counts[1],
    }


def _check(results: list[dict], experts_layout: tuple, block_groups: int = 1) -> None:
    for r in results:
        assert r["block_groups"] == block_groups, r
        assert r["losses_equal"] and r["grads_equal"] and r["layouts_equal"] and r["params_equal"], r
        assert r["counts_equal"], r["counts"]
        assert r["loss_vs_reference"] < 1e-6 and r["grad_vs_reference"] < 1e-6 and r["param_vs_reference"] < 1e-5, r
        assert r["grouped"]
        assert r["experts"][:2] == experts_layout, r["experts"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", [TORCHTITAN, "init_device_mesh"])
@pytest.mark.parametrize("num_experts", [4, 2])
def test_experts_on_efsdp_x_ep_match_torch_on_4_ranks(kind, num_experts):
    # dp 4 = efsdp 2 x ep 2. 4 experts: 2 per ep rank, one per efsdp rank (dim 0); 2 experts:
    # 1 per ep rank, fewer than the 4 shards, so dim 1 (hidden) is split.
    from torch.distributed.tensor.placement_types import _StridedShard
    # FSDP's efsdp chunks interleave with EP's on dim 0; on dim 1 they are a plain Shard(1).
    efsdp = _StridedShard(0, split_factor=2) if num_experts == 4 else Shard(1)
    _check(run_on_ranks(_train_vs_torch, 4, kind, num_experts, 2, timeout=300.0),
           (("efsdp", "ep"), (efsdp, Shard(0))))


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCHTITAN, reason="needs torchtitan")
def test_hsdp_experts_on_dp_replicate_x_efsdp_x_ep_match_torch():
    # torchtitan's HSDP: dp_replicate 2 x dp_shard 2, ep 2, so efsdp 1; dense on (dp_replicate,
    # fsdp), experts on (dp_replicate, efsdp): reduced over efsdp, then all-reduced over replicas.
    from torch.distributed.tensor.placement_types import Replicate, _StridedShard
    _check(run_on_ranks(_train_vs_torch, 4, "torchtitan-hsdp", 2, 2, timeout=300.0),
           (("dp_replicate", "efsdp", "ep"), (Replicate(), _StridedShard(0, split_factor=2), Shard(0))))


@pytest.mark.parametrize("kind", [TORCHTITAN, "init_device_mesh"])
def test_experts_on_efsdp_x_ep_match_torch_on_2_ranks(kind):
    # dp 2 = efsdp 1 x ep 2: one expert per ep rank, the efsdp axis a single rank.
    from torch.distributed.tensor.placement_types import _StridedShard
    _check(run_on_ranks(_train_vs_torch, 2, kind, 2, 2),
           (("efsdp", "ep"), (_StridedShard(0, split_factor=2), Shard(0))))


@pytest.mark.skipif(not HAS_TORCHTITAN or not HAS_SHARD_PLACEMENT_RESULT, reason="needs torchtitan, torch 2.13")
def test_torchtitans_apply_fsdp_with_ep_through_patch_torch_matches_torch():
    results = run_on_ranks(_train_vs_torch, 4, "torchtitan", 4, 2, 2, _shard_with_torchtitan, timeout=300.0)
    from torch.distributed.tensor.placement_types import _StridedShard
    _check(results, (("efsdp", "ep"), (_StridedShard(0, split_factor=2), Shard(0))), block_groups=2)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCHTITAN or not HAS_SHARD_PLACEMENT_RESULT, reason="needs torchtitan, torch 2.13")
def test_hsdp_experts_on_their_mesh_in_one_call_match_torch():
    # HSDP in one call: dense on (dp_replicate, fsdp), experts on (dp_replicate, efsdp) (efsdp 1).
    from torch.distributed.tensor.placement_types import Replicate, _StridedShard
    results = run_on_ranks(_train_vs_torch, 4, "torchtitan-hsdp", 2, 2, 2, _shard_one_call, timeout=300.0)
    _check(results, (("dp_replicate", "efsdp", "ep"), (Replicate(), _StridedShard(0, split_factor=2), Shard(0))),
           block_groups=2)


# ---- shard_placement_fn returning torch's ShardPlacementResult -----------------------------
@pytest.mark.skipif(not HAS_SHARD_PLACEMENT_RESULT, reason="torch 2.13's FSDP2 API")
@pytest.mark.parametrize("num_experts", [4, 2])
def test_experts_on_their_mesh_in_one_call_match_torch_on_4_ranks(num_experts):
    # torchtitan 0.3.0's layout with EP 2: one fully_shard per block, two parameter groups in it
    # (dense on fsdp, experts on efsdp); 4 experts on dim 0, 2 experts (fewer than the 4 shards) on dim 1.
    from torch.distributed.tensor.placement_types import _StridedShard
    efsdp = _StridedShard(0, split_factor=2) if num_experts == 4 else Shard(1)
    kind = "torchtitan" if HAS_TORCHTITAN else "init_device_mesh"
    results = run_on_ranks(_train_vs_torch, 4, kind, num_experts, 2, 2, _shard_one_call, timeout=300.0)
    _check(results, (("efsdp", "ep"), (efsdp, Shard(0))), block_groups=2)


def _placement_result_vs_torch(steps: int = 2) -> dict:
    """No EP (ep 1): torchtitan's path for experts fewer than the shards, written with
    ShardPlacementResult on the call's own mesh: experts Shard(1), the rest Shard(0)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    torch.manual_seed(0)
    base = MoEModel(2)
    dense, _, _ = _meshes("init_device_mesh", 1)
    info = _get_mesh_info(dense)
    models = []
    for fully_shard in (fsdp2.fully_shard, torch_fully_shard):
        model = copy.deepcopy(base)
        for block in model.layers:
            experts = set(block.moe.experts.parameters())
            fully_shard(block, mesh=dense, shard_placement_fn=lambda p, e=experts: ShardPlacementResult(
                placement=Shard(1) if p in e else None, mesh_info=info))
        fully_shard(model, mesh=dense)
        models.append(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    losses = []
    for step in range(steps):
        step_losses = [loss_of(m, *batch(dist.get_rank(), step)) for m in models]
        for loss in step_losses:
            loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append([loss.item() for loss in step_losses])
    named = [dict(m.named_parameters()) for m in models]
    return {
        "losses_equal": all(a == b for a, b in losses),
        "layouts_equal": all(_layout(p) == _layout(named[1][n]) for n, p in named[0].items()),
        "params_equal": all(torch.equal(p.full_tensor(), named[1][n].full_tensor()) for n, p in named[0].items()),
        "experts": _layout(named[0]["layers.0.moe.experts.w1"])[1],
    }


@pytest.mark.skipif(not HAS_SHARD_PLACEMENT_RESULT, reason="torch 2.13's FSDP2 API")
@pytest.mark.parametrize("world", [2, 4])
def test_shard_placement_result_on_the_calls_mesh_matches_torch(world):
    for r in run_on_ranks(_placement_result_vs_torch, world):
        assert r == {"losses_equal": True, "layouts_equal": True, "params_equal": True, "experts": (Shard(1),)}, r


def _int_reshard_on_several_meshes_vs_torch(steps: int = 2) -> dict:
    """reshard_after_forward=2 in one call over two meshes: dense on a 1-D mesh of 4 (after
    forward each rank keeps a half, gathered back over 2 ranks), experts on a (replicate 2,
    shard 2) mesh, where 2 is the whole shard axis (the same as True), as torch resolves it."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    torch.manual_seed(0)
    base = MoEModel(4)
    world = dist.get_world_size()
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "efsdp"))
    info = _get_mesh_info(hsdp)
    models = []
    for fully_shard in (fsdp2.fully_shard, torch_fully_shard):
        model = copy.deepcopy(base)
        for block in model.layers:
            experts = set(block.moe.experts.parameters())
            fully_shard(block, mesh=dense, reshard_after_forward=2, shard_placement_fn=lambda p, e=experts:
                        ShardPlacementResult(placement=Shard(0), mesh_info=info) if p in e else None)
        fully_shard(model, mesh=dense)
        _sum_gradients(model)
        models.append(model)
    reference = copy.deepcopy(base)
    run = _train_pair(models, reference, steps)
    losses, counts, grads_equal, grad_vs_reference = run.losses, run.counts, run.grads_equal, run.grad_vs_reference
    named = [dict(m.named_parameters()) for m in models]
    groups = fsdp2.fully_shard.state(models[0].layers[0])._fsdp_param_groups
    return {
        "losses_equal": all(a == b for a, b in losses),
        "grads_equal": grads_equal,
        "grad_vs_reference": grad_vs_reference < 1e-6,
        "counts_equal": counts[0] == counts[1],
        "layouts_equal": all(_layout(p) == _layout(named[1][n]) for n, p in named[0].items()),
        "params_equal": all(torch.equal(p.full_tensor(), named[1][n].full_tensor()) for n, p in named[0].items()),
        "block_groups": len(groups),
    }


@pytest.mark.skipif(not HAS_SHARD_PLACEMENT_RESULT, reason="torch 2.13's FSDP2 API")
def test_int_reshard_after_forward_on_several_meshes_matches_torch():
    for r in run_on_ranks(_int_reshard_on_several_meshes_vs_torch, 4):
        assert r == {"losses_equal": True, "grads_equal": True, "grad_vs_reference": True, "counts_equal": True,
                     "layouts_equal": True, "params_equal": True, "block_groups": 2}, r


def _accumulate_and_round_trip(steps: int = 2) -> dict:
    """Experts on their own mesh in one call (two groups per block), fsdp2 next to torch: two
    microbatches a step, the first without gradient sync and without resharding after backward,
    explicit prefetches; then the state dict, loaded into a fresh fsdp2 model."""
    from torch.distributed.tensor.debug import CommDebugMode
    torch.manual_seed(0)
    base = MoEModel(4)
    rank, world = dist.get_rank(), dist.get_world_size()
    dense, efsdp, ep = _meshes("init_device_mesh", 2)

    def sharded(fully_shard, scale: float = 1.0) -> MoEModel:
        model = copy.deepcopy(base)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        expert_parallel(model, ep)
        _shard_one_call(model, fully_shard, dense, efsdp, ep)
        model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])
        model.layers[1].set_modules_to_backward_prefetch([model.layers[0]])
        return model

    models = [sharded(fsdp2.fully_shard), sharded(torch_fully_shard)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    counts: list[list[dict]] = [[], []]
    for step in range(steps):
        for model, opt, seen in zip(models, opts, counts):
            for micro in range(2):  # (a mode per backward: its module tracker follows one)
                last = micro == 1
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
                with CommDebugMode() as mode:
                    (loss_of(model, *batch(rank, 10 * step + micro)) / world).backward()
                seen.append({str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items() if n})
            opt.step()
            opt.zero_grad()
    named = [dict(m.named_parameters()) for m in models]
    saved = models[0].state_dict()
    restored = sharded(fsdp2.fully_shard, 0.0)
    restored.load_state_dict(saved)
    again = {k: v.full_tensor() for k, v in restored.state_dict().items()}
    torch_saved = models[1].state_dict()
    ids, targets = batch(rank, 99)
    return {
        "counts_equal": counts[0] == counts[1],
        "no_sync_fewer": counts[0][0].get("_reduce_scatter_base_", 0) < counts[0][1]["_reduce_scatter_base_"],
        "params_equal": all(torch.equal(p.full_tensor(), named[1][n].full_tensor()) for n, p in named[0].items()),
        "keys_equal": list(saved) == list(torch_saved),
        "layouts_equal": all(_layout(v) == _layout(torch_saved[k]) for k, v in saved.items()),
        "round_trip": all(torch.equal(again[k], v.full_tensor()) for k, v in saved.items()),
        "same_loss": loss_of(restored, ids, targets).item() == loss_of(models[0], ids, targets).item(),
    }


@pytest.mark.skipif(not HAS_SHARD_PLACEMENT_RESULT, reason="torch 2.13's FSDP2 API")
def test_experts_in_one_call_accumulate_prefetch_and_round_trip_like_torch():
    for r in run_on_ranks(_accumulate_and_round_trip, 4, timeout=300.0):
        assert r == {"counts_equal": True, "no_sync_fewer": True, "params_equal": True, "keys_equal": True,
                     "layouts_equal": True, "round_trip": True, "same_loss": True}, r


def _refusals() -> list[str]:
    """What fsdp2 refuses (before any change) and whether torch refuses it too."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    dense, efsdp, ep = _meshes("init_device_mesh", 2)
    seen = []
    # 1. A mesh per parameter (one group each) with what fsdp2 does not combine with it yet:
    # quantized communication; a mesh_info whose axes are not (replicate, shard).
    model = MoEModel(4)
    expert_parallel(model, ep)
    block = model.layers[0]
    before = dict(block.named_parameters())
    experts, info = set(block.moe.experts.parameters()), _get_mesh_info(efsdp)
    with pytest.raises(ValueError, match="does not combine parameter groups on several meshes with comm_policy"):
        fsdp2.fully_shard(block, mesh=dense, comm_policy=fsdp2.QuantizedComm(weights="int8"),
                          shard_placement_fn=lambda p: ShardPlacementResult(
            placement=Shard(0), mesh_info=info) if p in experts else None)
    # An int reshard_after_forward must divide every group's shard axis (the experts' is 2), as torch's.
    with pytest.raises(ValueError, match="reshard_after_forward=4 must divide the mesh size 2"):
        fsdp2.fully_shard(block, mesh=dense, reshard_after_forward=4, shard_placement_fn=lambda p: ShardPlacementResult(
            placement=Shard(0), mesh_info=info) if p in experts else None)
    transposed = type(info)(efsdp, shard_mesh_dim=0)
    transposed.replicate_mesh_dim = 0  # (a shape fsdp2 does not read: the shard axis is a 2-D mesh's last)
    with pytest.raises(ValueError, match="fsdp2 shards over a 1-D mesh or a 2-D"):
        fsdp2.fully_shard(block, mesh=dense, shard_placement_fn=lambda p: ShardPlacementResult(
            placement=Shard(0), mesh_info=transposed) if p in experts else None)
    assert dict(block.named_parameters()) == before and not isinstance(block, fsdp2.FSDPModule)
    # A custom comm or all-reduce hook would be ambiguous across the groups: refused, as torch does.
    fsdp2.fully_shard(block, mesh=dense, shard_placement_fn=lambda p: ShardPlacementResult(
        placement=Shard(0), mesh_info=info) if p in experts else None)
    with pytest.raises(ValueError, match="2 parameter groups, one per mesh"):
        block.set_all_reduce_hook(lambda t: None)
    seen.append("mesh per parameter")
    # 2. An expert mesh that cannot be joined with the data-parallel one (the same ranks' axis):
    # torch's fully_shard refuses it too.
    world = dist.get_world_size()
    other = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for fully_shard, error in ((fsdp2.fully_shard, ValueError), (torch_fully_shard, RuntimeError)):
        module = nn.Linear(8, 8)
        module.weight = nn.Parameter(distribute_tensor(module.weight.data, other, [Shard(0)]))
        weight = module.weight
        match = "cannot be joined with the data-parallel mesh" if fully_shard is fsdp2.fully_shard else None
        with pytest.raises(error, match=match):
            fully_shard(module, mesh=dense)
        if fully_shard is fsdp2.fully_shard:
            assert module.weight is weight and not isinstance(module, fsdp2.FSDPModule)
    seen.append("unjoinable mesh")
    # 3. Not a placement at all, or a result without a mesh.
    with pytest.raises(TypeError, match="return Shard\\(dim\\), None or a ShardPlacementResult"):
        fsdp2.fully_shard(nn.Linear(4, 4), mesh=dense, shard_placement_fn=lambda p: "dim 0")
    with pytest.raises(TypeError, match="whose mesh_info has no DeviceMesh"):
        fsdp2.fully_shard(nn.Linear(4, 4), mesh=dense, shard_placement_fn=lambda p: ShardPlacementResult(
            placement=None, mesh_info=dense))
    seen.append("bad result")
    return seen


@pytest.mark.skipif(not HAS_SHARD_PLACEMENT_RESULT, reason="torch 2.13's FSDP2 API")
def test_refusals_name_the_fix_and_leave_the_module_unchanged():
    assert run_on_ranks(_refusals, 4) == [["mesh per parameter", "unjoinable mesh", "bad result"]] * 4


# ---- checkpoints of experts on their own meshes ---------------------------------------------
def _checkpoint_across_implementations(path: str) -> list[str]:
    """DCP: fsdp2's MoE model saved, loaded into torch's (and into fsdp2's), same values everywhere."""
    import torch.distributed.checkpoint as dcp
    torch.manual_seed(0)
    base = MoEModel(4)
    dense, efsdp, ep = _meshes("init_device_mesh", 2)

    def sharded(fully_shard, scale: float) -> MoEModel:
        model = copy.deepcopy(base)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        expert_parallel(model, ep)
        _shard(model, fully_shard, dense, efsdp, ep)
        return model

    saved = sharded(fsdp2.fully_shard, 1.0)
    expected = {k: v.full_tensor() for k, v in saved.state_dict().items()}
    dcp.save(saved.state_dict(), checkpoint_id=path)
    for fully_shard in (torch_fully_shard, fsdp2.fully_shard):
        restored = sharded(fully_shard, 0.0)
        state = restored.state_dict()
        dcp.load(state, checkpoint_id=path)
        restored.load_state_dict(state)
        for key, value in restored.state_dict().items():
            assert torch.equal(value.full_tensor(), expected[key]), key
    return sorted(k for k in expected if "experts" in k)


def test_experts_checkpoint_round_trips_between_fsdp2_and_torch(tmp_path):
    # Three models, a save and two loads: more than the default minute or two on a loaded CPU.
    results = run_on_ranks(_checkpoint_across_implementations, 4, str(tmp_path / "ckpt"), timeout=300.0)
    assert results == [[f"layers.{i}.moe.experts.{w}" for i in range(2) for w in ("w1", "w2")]] * 4
