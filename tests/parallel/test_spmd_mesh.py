"""``fully_shard(module, mesh=full_mesh, dp_mesh_dims=...)``: parameters already DTensors on a whole
SPMD mesh (data-parallel x tensor-parallel), sharded over the named data-parallel axis.

Checked against torch's ``fully_shard`` with the same ``dp_mesh_dims``: the same sharded
placements (``_StridedShard`` where a TP axis to the right shards the same dim), the same local
shards, losses and parameters after AdamW steps; HSDP (a replicate axis) against an unsharded
reference; bad meshes and parameters raise before anything changes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fsdp2
from tests._dist import run_on_ranks
from tests._parity import assert_grads_are_average, full
from tests._torch import HAS_DATA_PARALLEL_MESH_DIMS

# torch 2.13 added dp_mesh_dims; with an older torch fsdp2's is checked without torch's beside it.
TorchDims = getattr(torch.distributed.fsdp, "DataParallelMeshDims", None)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


# Megatron-style TP on the "tp" axis; every parameter replicated on the data-parallel axes.
_TP = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1), "down.bias": Replicate()}


def _on_mesh(model: nn.Module, mesh, tp_axis: str | None) -> nn.Module:
    """Every parameter a DTensor on the whole ``mesh``: TP placements on ``tp_axis``, Replicate elsewhere."""
    for name, p in list(model.named_parameters()):
        placements = [_TP[name] if axis == tp_axis else Replicate() for axis in mesh.mesh_dim_names]
        owner, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        setattr(owner, attr, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    return model


def _loss(model: nn.Module, mesh, x: torch.Tensor, batch_axis: str) -> torch.Tensor:
    """This rank's batch ``x`` as a DTensor sharded over the batch axis; the loss on the local output."""
    placements = [Shard(0) if axis == batch_axis else Replicate() for axis in mesh.mesh_dim_names]
    out = model(DTensor.from_local(x, mesh, placements))
    local = out.redistribute(mesh, placements).to_local()
    return (local ** 2).mean()


def _train(impl: str, names: tuple[str, str]) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    model = _on_mesh(_MLP(), mesh, "tp")
    if impl == "fsdp2":
        fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=fsdp2.DataParallelMeshDims(shard="dp"))
    else:
        # torch compares meshes by identity, and nn.Parameter(dtensor) may return the DTensor on an
        # equal mesh an earlier test built (DTensor's op cache): give torch the parameters' own.
        mesh = model.up.weight.device_mesh
        torch_fully_shard(model, mesh=mesh, dp_mesh_dims=TorchDims(shard="dp"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank = mesh.get_local_rank("dp")
    losses = []
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dp_rank))
        loss = _loss(model, mesh, x, "dp")
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        return {
            "placements": {n: [repr(pl) for pl in p.placements] for n, p in model.named_parameters()},
            "local": {n: p.to_local().clone() for n, p in model.named_parameters()},
            "full": {n: full(p) for n, p in model.named_parameters()},
            "losses": losses,
        }


@pytest.mark.parametrize("names", [("dp", "tp"), ("tp", "dp")])
def test_dp_mesh_dims_shards_like_torch(names):
    ours = run_on_ranks(_train, 4, "fsdp2", names)
    theirs = run_on_ranks(_train, 4, "torch", names) if HAS_DATA_PARALLEL_MESH_DIMS else ours
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert a["placements"] == b["placements"], rank
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5), rank
        for name in a["local"]:
            torch.testing.assert_close(a["local"][name], b["local"][name], msg=lambda m: f"{rank} {name}: {m}")
            torch.testing.assert_close(a["full"][name], b["full"][name], msg=lambda m: f"{rank} {name}: {m}")
    if names == ("dp", "tp"):  # "up" is cut by TP on dim 0 first, to the right of dp: strided
        assert ours[0]["placements"]["up.weight"][0] == "_StridedShard(dim=0, sf=2)"
        assert ours[0]["placements"]["down.weight"] == ["Shard(dim=0)", "Shard(dim=1)"]
    else:
        assert ours[0]["placements"]["up.weight"] == ["Shard(dim=0)", "Shard(dim=0)"]


def _hsdp_on_a_full_mesh() -> list[object]:
    """(rep, shard) named on a 2 x 2 mesh, no TP: gradients are the average over all four ranks."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    ref = _MLP()
    model = _on_mesh(copy.deepcopy(ref), mesh, None)
    fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=fsdp2.DataParallelMeshDims(shard="shard", replicate="rep"))
    assert [repr(pl) for pl in model.up.weight.placements] == ["Replicate()", "Shard(dim=0)"]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    _loss(model, mesh, x, "shard").backward()  # each rank its own batch
    (ref(x) ** 2).mean().backward()
    assert_grads_are_average(ref, model)
    return ["ok"]


def test_dp_mesh_dims_with_a_replicate_axis_is_hsdp():
    assert run_on_ranks(_hsdp_on_a_full_mesh, 4) == [["ok"]] * 4


def _bad_spmd_arguments() -> list[object]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dims = fsdp2.DataParallelMeshDims(shard="dp")
    plain = _MLP()
    before = {n: p for n, p in plain.named_parameters()}
    with pytest.raises(ValueError, match="'up.weight' is a plain tensor. Distribute it first"):
        fsdp2.fully_shard(plain, mesh=mesh, dp_mesh_dims=dims)
    assert {n: p for n, p in plain.named_parameters()} == before and not isinstance(plain, fsdp2.FSDPModule)
    sharded_on_dp = _on_mesh(_MLP(), mesh, "dp")
    with pytest.raises(ValueError, match="'up.weight' is Shard\\(dim=0\\) on data-parallel axis 'dp'"):
        fsdp2.fully_shard(sharded_on_dp, mesh=mesh, dp_mesh_dims=dims)
    model = _on_mesh(_MLP(), mesh, "tp")
    with pytest.raises(ValueError, match="names axis 'cp', which the mesh \\('dp', 'tp'\\) does not have"):
        fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=fsdp2.DataParallelMeshDims(shard="cp"))
    with pytest.raises(ValueError, match="replication only\\) is plain data parallelism"):
        fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=fsdp2.DataParallelMeshDims(replicate="dp"))
    with pytest.raises(ValueError, match="shard axes \\('tp', 'dp'\\) must be named in the mesh's order"):
        fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=fsdp2.DataParallelMeshDims(shard=("tp", "dp")))
    with pytest.raises(ValueError, match="uses axis 'dp' twice"):
        fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=fsdp2.DataParallelMeshDims(shard="dp", replicate="dp"))
    wide = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="reshard_after_forward=2 \\(int\\) is not supported with dp_mesh_dims"):
        fsdp2.fully_shard(_on_mesh(_MLP(), wide, "tp"), mesh=wide, reshard_after_forward=2, dp_mesh_dims=dims)
    with pytest.raises(TypeError, match="dp_mesh_dims must be a DataParallelMeshDims, got str"):
        fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims="dp")
    with pytest.raises(ValueError, match="set at least one of shard and replicate"):
        fsdp2.DataParallelMeshDims()
    assert not isinstance(model, fsdp2.FSDPModule)
    if TorchDims is not None:
        fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=TorchDims(shard="dp"))  # torch's own type is accepted
    return ["ok"]


def test_dp_mesh_dims_errors_leave_the_module_unchanged():
    assert run_on_ranks(_bad_spmd_arguments, 4) == [["ok"]] * 4


def _checkpoint_round_trip(path: str) -> list[object]:
    """State dict, DCP save/load and full-tensor load of parameters sharded on a whole mesh."""
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dims = fsdp2.DataParallelMeshDims(shard="dp")

    def sharded(scale: float) -> nn.Module:
        model = _on_mesh(_MLP(), mesh, "tp")
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        return fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)

    model = sharded(1.0)
    saved = {k: v.full_tensor() for k, v in model.state_dict().items()}
    dcp.save(model.state_dict(), checkpoint_id=path)
    restored = sharded(0.0)
    state = restored.state_dict()
    dcp.load(state, checkpoint_id=path)
    restored.load_state_dict(state)
    from_full = sharded(0.0)
    from_full.load_state_dict(saved)
    for other in (restored, from_full):
        for key, value in other.state_dict().items():
            assert torch.equal(value.full_tensor(), saved[key]), key
    return ["ok"]


def test_dp_mesh_dims_checkpoint_round_trip(tmp_path):
    assert run_on_ranks(_checkpoint_round_trip, 4, str(tmp_path / "ckpt")) == [["ok"]] * 4


# ---- several axes of a kind, flattened into one (torch's fully_shard does the same) ----------
def _train_flattened(impl: str, shape: tuple[int, ...], names: tuple[str, ...], shard: tuple[str, ...],
                     replicate: tuple[str, ...] | None) -> dict[str, object]:
    """tp is 1 here: every rank its own batch, sharded over every data-parallel axis."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _on_mesh(_MLP(), mesh, "tp")
    if impl == "fsdp2":
        fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=fsdp2.DataParallelMeshDims(shard=shard, replicate=replicate))
    else:
        torch_fully_shard(model, mesh=model.up.weight.device_mesh, dp_mesh_dims=TorchDims(shard=shard,
                                                                                          replicate=replicate))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    placements = [Shard(0) if axis in shard + (replicate or ()) else Replicate() for axis in names]
    losses = []
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        out = model(DTensor.from_local(x, mesh, placements))
        loss = (out.redistribute(mesh, placements).to_local() ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        return {
            "layout": {n: (p.device_mesh.mesh_dim_names, [repr(pl) for pl in p.placements])
                       for n, p in model.named_parameters()},
            "local": {n: p.to_local().clone() for n, p in model.named_parameters()},
            "full": {n: full(p) for n, p in model.named_parameters()},
            "losses": losses,
        }


# The cases of one mesh shape name their axes alike: torch caches DTensor's sharding propagation per
# mesh (names included), and on a 4-D mesh its first training step spends ~20 s there (CPU).
FLATTENED = {  # shape, names, shard, replicate -> the sharded weights' mesh axes and placements
    "two shard axes": ((2, 2, 1), ("d0", "d1", "tp"), ("d0", "d1"), None,
                       (("d0_d1", "tp"), ["Shard(dim=0)", "Shard(dim=0)"])),
    "two replicate axes": ((2, 1, 2, 1), ("d0", "d1", "d2", "tp"), ("d2",), ("d0", "d1"),
                           (("d0", "d1", "d2", "tp"), ["Replicate()", "Replicate()", "Shard(dim=0)", "Shard(dim=0)"])),
    "replicate axis after the shard axis": ((2, 2, 1), ("d0", "d1", "tp"), ("d0",), ("d1",),
                                            (("d0", "d1", "tp"), ["Shard(dim=0)", "Replicate()", "Shard(dim=0)"])),
    "hsdp, two shard axes": ((2, 1, 2, 1), ("d0", "d1", "d2", "tp"), ("d1", "d2"), ("d0",),
                             (("d0", "d1_d2", "tp"), ["Replicate()", "Shard(dim=0)", "Shard(dim=0)"])),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FLATTENED))
def test_dp_mesh_dims_with_several_axes_flattens_them_like_torch(case):
    shape, names, shard, replicate, up_weight = FLATTENED[case]
    # (new process groups for the flattened axes: slow to start on a loaded CPU)
    ours = run_on_ranks(_train_flattened, 4, "fsdp2", shape, names, shard, replicate, timeout=300.0)
    theirs = run_on_ranks(_train_flattened, 4, "torch", shape, names, shard, replicate, timeout=300.0) \
        if HAS_DATA_PARALLEL_MESH_DIMS else ours
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert a["layout"] == b["layout"] and a["losses"] == b["losses"], rank
        for name in a["local"]:
            assert torch.equal(a["local"][name], b["local"][name]), (rank, name)
            assert torch.equal(a["full"][name], b["full"][name]), (rank, name)
    assert ours[0]["layout"]["up.weight"] == up_weight
