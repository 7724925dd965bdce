"""``fully_shard(..., dp_mesh_dims=...)`` with a ``shard_placement_fn`` that puts some parameters on
other meshes (torch 2.13's ``ShardPlacementResult``): one parameter group per mesh.

A result's ``mesh_info`` decides its group's kind, as torch's: one naming ``dp_mesh_dims`` (torch's
``_get_mesh_info(spmd_mesh, dims)``) is a second SPMD mesh with axis names of its own (the
experts' ``("efsdp", "ep")``, sharded over ``efsdp``, ``Shard(0)`` on ``ep``; or, HSDP, sharded
over ``ep`` and replicated over ``efsdp``); one without is a
plain data-parallel mesh (a 1-D mesh of every rank) for plain parameters; and the other way
round, a call on that plain mesh whose results put the rest on the SPMD meshes. fsdp2 and torch's
``fully_shard`` train the same model side by side, and an unsharded reference on every rank's
batch: losses, gradients, layouts, parameters and the collectives CommDebugMode counts must equal
torch's (``torch.equal``), and the reference within float rounding. On torch 2.11 (no
``dp_mesh_dims`` in its FSDP2) fsdp2 alone is checked, against the reference.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fsdp2
from fsdp2.runtime._state import get_state
from tests._dist import run_on_ranks
from tests._torch import HAS_DATA_PARALLEL_MESH_DIMS

BATCH = (Shard(0), Replicate())  # a rank's batch: split over the first (data-parallel) axis


class _Body(nn.Module):
    """A TP MLP on the ("dp", "tp") mesh, experts on ("efsdp", "ep"), a plain gate."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.experts = nn.Linear(8, 8, bias=False)
        self.gate = nn.Linear(8, 8)
        self.meshes: tuple[DeviceMesh, DeviceMesh] | None = None  # None: the unsharded reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.meshes is None:
            h = self.down(F.relu(self.up(x)))
            return F.linear(h, self.experts.weight) + self.gate(h)
        mesh, expert_mesh = self.meshes
        h = self.down(F.relu(self.up(DTensor.from_local(x, mesh, BATCH))))
        h = h.redistribute(mesh, BATCH).to_local()
        experts = F.linear(DTensor.from_local(h, expert_mesh, BATCH), self.experts.weight)
        return experts.redistribute(expert_mesh, BATCH).to_local() + self.gate(h)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = _Body()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.body.meshes is None:
            return self.head(h)
        mesh = self.body.meshes[0]
        return self.head(DTensor.from_local(h, mesh, BATCH)).redistribute(mesh, BATCH).to_local()


# Megatron-style TP on "tp"; the experts' output features split over "ep".
_PLACEMENTS = {"body.up.weight": Shard(0), "body.up.bias": Shard(0), "body.down.weight": Shard(1),
               "body.experts.weight": Shard(0)}


def _distribute(model: _Model, mesh: DeviceMesh, expert_mesh: DeviceMesh, ep: bool = True) -> _Model:
    """Every parameter but the gate's a DTensor on its whole SPMD mesh, Replicate() on the first
    axis (the experts replicated on both without ``ep``)."""
    for name, p in list(model.named_parameters()):
        if name.startswith("body.gate"):
            continue
        on = expert_mesh if name.startswith("body.experts") else mesh
        second = _PLACEMENTS.get(name, Replicate()) if ep or on is mesh else Replicate()
        placements = [Replicate(), second]
        owner, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        setattr(owner, attr, nn.Parameter(distribute_tensor(p.detach(), on, placements)))
    model.body.meshes = (mesh, expert_mesh)
    return model


@dataclass
class _MeshInfo:  # torch 2.11 has no FSDPMeshInfo: what fsdp2 reads of one
    mesh: DeviceMesh
    shard_mesh_dim: int = 0
    replicate_mesh_dim: int | None = None
    dp_mesh_dims: Any = None
    spmd_mesh: DeviceMesh | None = None


@dataclass
class _Result:  # torch 2.11 has no ShardPlacementResult
    placement: Shard | None
    mesh_info: Any


def _mesh_info(mesh: DeviceMesh, dims: Any = None) -> Any:
    if HAS_DATA_PARALLEL_MESH_DIMS:
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
        return _get_mesh_info(mesh, dims)
    if dims is None:
        return _MeshInfo(mesh)
    return _MeshInfo(mesh[dims.shard_names[0]], dp_mesh_dims=dims, spmd_mesh=mesh)


def _result(placement: Shard | None, info: Any) -> Any:
    if HAS_DATA_PARALLEL_MESH_DIMS:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
        return ShardPlacementResult(placement=placement, mesh_info=info)
    return _Result(placement, info)


def _dims(impl: str, **names: str) -> Any:
    if impl == "torch":
        return torch.distributed.fsdp.DataParallelMeshDims(**names)
    return fsdp2.DataParallelMeshDims(**names)


def _placement_fn(p: nn.Parameter, experts: set, gate: set, experts_info: Any, world_info: Any,
                  dense_info: Any = None) -> Any:
    if p in experts:
        return _result(Shard(1), experts_info)
    if p in gate:
        return _result(None, world_info) if world_info is not None else None
    return _result(None, dense_info) if dense_info is not None else None  # None: Shard(0) on the call's mesh


def _shard(model: _Model, impl: str, world: DeviceMesh, call: str) -> None:
    """``call="spmd"``: the body's call has dp_mesh_dims, the experts and the gate go elsewhere;
    ``"hsdp"``: the same, the experts (no EP) sharded over ``ep`` and replicated over ``efsdp``;
    ``"plain"``: the call is on the 1-D world mesh (the gate's), the rest on SPMD meshes."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    fully_shard = fsdp2.fully_shard if impl == "fsdp2" else torch_fully_shard
    # torch compares SPMD meshes by identity, and nn.Parameter(dtensor) may hand back the DTensor on
    # an equal mesh an earlier test built (DTensor's cache): give torch the parameters' own.
    mesh, expert_mesh = model.body.up.weight.device_mesh, model.body.experts.weight.device_mesh
    body = model.body
    fn = functools.partial(_placement_fn, experts=set(body.experts.parameters()), gate=set(body.gate.parameters()),
                           experts_info=_mesh_info(expert_mesh, _dims(impl, shard="ep", replicate="efsdp")
                                                   if call == "hsdp" else _dims(impl, shard="efsdp")),
                           world_info=_mesh_info(world) if call != "plain" else None,
                           dense_info=_mesh_info(mesh, _dims(impl, shard="dp")) if call == "plain" else None)
    if call != "plain":
        fully_shard(body, mesh=mesh, dp_mesh_dims=_dims(impl, shard="dp"), shard_placement_fn=fn,
                    reshard_after_forward=True)
    else:
        fully_shard(body, mesh=world, shard_placement_fn=fn, reshard_after_forward=True)
    fully_shard(model, mesh=model.head.weight.device_mesh, dp_mesh_dims=_dims(impl, shard="dp"))


def _layout(p: DTensor) -> tuple:
    return p.device_mesh.mesh_dim_names, tuple(repr(pl) for pl in p.placements), tuple(p.to_local().shape)


def _train(call: str, steps: int = 3) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    expert_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    reference = _Model()
    impls = ["fsdp2", "torch"] if HAS_DATA_PARALLEL_MESH_DIMS else ["fsdp2"]
    models = []
    for impl in impls:
        model = _distribute(copy.deepcopy(reference), mesh, expert_mesh, ep=call != "hsdp")
        _shard(model, impl, world, call)
        models.append(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (*models, reference)]
    dp_rank = mesh.get_local_rank("dp")
    losses, counts, grads_equal, grad_vs_reference, loss_vs_reference = [], [], True, 0.0, 0.0
    for step in range(steps):
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(2)]
        step_losses, step_counts = [], []
        for m in models:
            with CommDebugMode() as mode:
                loss = (m(xs[dp_rank]) ** 2).mean()
                loss.backward()
            step_losses.append(loss.item())
            step_counts.append({str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items() if n})
        per_rank = [(reference(x) ** 2).mean() for x in xs]
        (sum(per_rank) / len(xs)).backward()  # FSDP averages over the data-parallel ranks
        grads = [[p.grad.full_tensor() for p in m.parameters()] for m in models]
        grads_equal &= all(torch.equal(a, b) for a, b in zip(*grads)) if len(models) > 1 else True
        grad_vs_reference = max(grad_vs_reference, *((g - r.grad).abs().max().item()
                                                     for g, r in zip(grads[0], reference.parameters())))
        loss_vs_reference = max(loss_vs_reference, abs(step_losses[0] - per_rank[dp_rank].item()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(step_losses)
        counts.append(step_counts)
    named = [dict(m.named_parameters()) for m in models]
    return {
        "groups": [[p.fqn for p in g.params] for g in get_state(models[0].body).groups],
        "layouts": [{n: _layout(p) for n, p in ps.items()} for ps in named],
        "losses": losses,
        "counts": counts,
        "grads_equal": grads_equal,
        "params_equal": all(torch.equal(p.full_tensor(), named[-1][n].full_tensor()) for n, p in named[0].items()),
        "loss_vs_reference": loss_vs_reference,
        "grad_vs_reference": grad_vs_reference,
        "param_vs_reference": max((p.full_tensor() - r).abs().max().item()
                                  for p, r in zip(named[0].values(), reference.parameters())),
    }


@pytest.mark.parametrize("call", ["spmd", "hsdp", "plain"])
def test_second_mesh_by_shard_placement_result_with_dp_mesh_dims_matches_torch(call):
    results = run_on_ranks(_train, 4, call, timeout=300.0)
    for rank, r in enumerate(results):
        assert r["groups"] == [["up.weight", "up.bias", "down.weight", "down.bias"], ["experts.weight"],
                               ["gate.weight", "gate.bias"]], r["groups"]
        ours = r["layouts"][0]
        assert ours["body.up.weight"] == (("dp", "tp"), ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), (4, 8))
        experts = ("Replicate()", "Shard(dim=1)") if call == "hsdp" else ("Shard(dim=1)", "Shard(dim=0)")
        assert ours["body.experts.weight"] == (("efsdp", "ep"), experts, (8, 4) if call == "hsdp" else (4, 4))
        assert ours["body.gate.weight"] == (("world",), ("Shard(dim=0)",), (2, 8))
        assert r["loss_vs_reference"] < 1e-6 and r["grad_vs_reference"] < 1e-6, r
        assert r["param_vs_reference"] < 1e-5, r
        if HAS_DATA_PARALLEL_MESH_DIMS:  # the same as torch's, bit for bit
            assert r["layouts"][0] == r["layouts"][1], rank
            assert all(a == b for a, b in r["losses"]), r["losses"]
            assert r["grads_equal"] and r["params_equal"], rank
            assert all(a == b for a, b in r["counts"]), r["counts"]


def _refusals() -> list[object]:
    """What torch's fully_shard refuses in this combination, fsdp2 refuses too, before any change."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    expert_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))

    def attempt(impl: str, error: type, match: str, body: _Body, experts_info: Any = None, gate_info: Any = None,
                **kwargs: Any) -> None:
        fully_shard = fsdp2.fully_shard if impl == "fsdp2" else torch_fully_shard
        experts_info = experts_info or _mesh_info(body.experts.weight.device_mesh, _dims(impl, shard="efsdp"))
        fn = functools.partial(_placement_fn, experts=set(body.experts.parameters()),
                               gate=set(body.gate.parameters()), experts_info=experts_info,
                               world_info=gate_info or _mesh_info(body.up.weight.device_mesh["dp"]))
        before = dict(body.named_parameters())
        with pytest.raises(error, match=match if impl == "fsdp2" else None):
            fully_shard(body, mesh=body.up.weight.device_mesh, dp_mesh_dims=_dims(impl, shard="dp"),
                        shard_placement_fn=fn, **kwargs)
        if impl == "fsdp2":
            assert dict(body.named_parameters()) == before and not isinstance(body, fsdp2.FSDPModule)

    impls = ["fsdp2", "torch"] if HAS_DATA_PARALLEL_MESH_DIMS else ["fsdp2"]
    for impl in impls:
        def fresh() -> _Body:
            return _distribute(_Model(), mesh, expert_mesh).body
        # The gate on the call's own process groups, but as a plain mesh: one group cannot be both.
        attempt(impl, ValueError, "puts 'gate.weight' on a plain data-parallel mesh .* one parameter group cannot "
                "be both", fresh())
        # An int reshard_after_forward, even one equal to the shard axis's size.
        world = _mesh_info(init_device_mesh("cpu", (4,), mesh_dim_names=("world",)))
        attempt(impl, ValueError if impl == "fsdp2" else NotImplementedError,
                "reshard_after_forward=2 \\(int\\) is not supported with dp_mesh_dims", fresh(), gate_info=world,
                reshard_after_forward=2)
        # The experts' mesh_info names dp_mesh_dims: they must be DTensors on that mesh, replicated on efsdp.
        plain = fresh()
        plain.experts.weight = nn.Parameter(plain.experts.weight.full_tensor().detach())
        attempt(impl, ValueError, "'experts.weight' is a plain tensor", plain, gate_info=world,
                experts_info=_mesh_info(expert_mesh, _dims(impl, shard="efsdp")))
        sharded = fresh()
        sharded.experts.weight = nn.Parameter(distribute_tensor(
            sharded.experts.weight.full_tensor().detach(), expert_mesh, [Shard(0), Shard(1)]))
        attempt(impl, ValueError, "'experts.weight' is Shard\\(dim=0\\) on data-parallel axis 'efsdp'", sharded,
                gate_info=world)
    # fsdp2's own comm_policy is not combined with several meshes yet.
    attempt("fsdp2", ValueError, "several meshes with comm_policy", fresh(), gate_info=world,
            comm_policy=fsdp2.QuantizedComm(weights="int8"))
    return ["ok"]


def test_what_torch_refuses_fsdp2_refuses_before_any_change():
    assert run_on_ranks(_refusals, 4, timeout=300.0) == [["ok"]] * 4
