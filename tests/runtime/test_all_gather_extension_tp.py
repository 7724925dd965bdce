"""The all-gather extension with tensor parallelism, and sharded on a dim other than 0.

The subclass is ``Bf16Gathered``: an fp32 tensor whose ``fsdp_pre_all_gather`` hands FSDP a
bf16 copy of its shard and whose ``fsdp_post_all_gather`` rebuilds an fp32 ``Bf16Gathered``
from the gathered bf16 values, so the model computes with its weights rounded to bf16 (the
unsharded reference does so explicitly, the gradient going straight through). Trained on a
2-D (dp, tp) mesh (``parallelize_module``'s DTensor parameters whose local tensor is the
subclass) and sharded on dim 1, fsdp2 matches torch's ``fully_shard`` bit for bit and the
reference within float tolerance; the tests also pin what the hooks receive (as torch's) and
the errors for what stays unsupported.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map_only

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from tests._dist import environ, run_on_ranks

DIM = 16
aten = torch.ops.aten


class Bf16Gathered(torch.Tensor):
    """fp32 values gathered as bf16. Shape ops keep the subclass; compute ops see plain fp32
    (their results and gradients are plain); in-place ops (the optimizer's) update the values."""

    calls: list = []  # (hook, what it got) per call in this process, read by the tests

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Bf16Gathered:
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, data.stride(), data.storage_offset(),
                                                   dtype=data.dtype, device=data.device)

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __repr__(self) -> str:
        return f"Bf16Gathered({tuple(self.shape)})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, _meta: Any, _size: Any, _stride: Any) -> Bf16Gathered:
        return Bf16Gathered(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*tree_map_only(cls, _unwrap, args), **tree_map_only(cls, _unwrap, kwargs))
        if func._schema.is_mutable and isinstance(args[0], cls):
            return args[0]
        if func in _KEEPS_SUBCLASS:
            return tree_map_only(torch.Tensor, cls, out)
        return out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        Bf16Gathered.calls.append(("pre", tuple(self.shape), tuple(outer_size), mesh.ndim, mesh.size()))
        return (self._data.to(torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        kind = None if out is None else (type(out).__name__, tuple(out.shape))
        Bf16Gathered.calls.append(("post", tuple(gathered.shape), str(gathered.dtype), kind))
        if out is not None:  # refill the rebuilt values in place (sharded on dim 1: reshaped as out)
            local = out._local_tensor if isinstance(out, DTensor) else out
            with torch.no_grad():
                local._data.copy_(gathered.view(local.shape))
            return None
        values = gathered.to(param_dtype)
        return Bf16Gathered(values), (values,)


def _unwrap(t: Bf16Gathered) -> torch.Tensor:
    return t._data


# The ops fully_shard and DTensor run on a parameter's shards and unsharded tensor.
_KEEPS_SUBCLASS = {aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
                   aten.as_strided.default, aten.slice.Tensor, aten.narrow.default, aten.split.Tensor,
                   aten.split_with_sizes.default, aten.new_zeros.default, aten.clone.default,
                   aten._to_copy.default, aten.empty_like.default, aten.zeros_like.default}


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The full values of a (possibly sharded, possibly Bf16Gathered) tensor, as a plain tensor."""
    if isinstance(t, DTensor):
        local = t._local_tensor.detach()
        local = local._data if isinstance(local, Bf16Gathered) else local
        t = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                               shape=t.shape, stride=t.stride()).full_tensor()
    return t._data if isinstance(t, Bf16Gathered) else t


class RoundedLinear(nn.Linear):
    """The reference: computes with its weight rounded to bf16, the gradient straight through."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return nn.functional.linear(x, w + (w.to(torch.bfloat16).float() - w).detach(), self.bias)


class Net(nn.Module):
    def __init__(self, linear: type = nn.Linear) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(linear(DIM, 2 * DIM), nn.Tanh(), linear(2 * DIM, DIM))
                                     for _ in range(2)])
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _build(mesh, tp: bool) -> nn.Module:
    """The model, its block weights ``Bf16Gathered`` (with ``tp``, parallelized first: their
    TP-local tensors become the subclass)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        if tp:
            parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for linear in (block[0], block[2]):
            w = linear.weight.detach()
            if isinstance(w, DTensor):
                local = Bf16Gathered(w.to_local().clone())
                w = DTensor.from_local(local, w.device_mesh, w.placements, run_check=False,
                                       shape=w.shape, stride=w.stride())
            else:
                w = Bf16Gathered(w.clone())
            linear.weight = nn.Parameter(w)
    return model


def _shard(model: nn.Module, fully_shard, mesh, **kwargs) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _train(tp: bool, dim: int, transport: str, steps: int = 3, mp: bool = False) -> dict:
    """fsdp2, torch's fully_shard and the unsharded reference side by side; compared every step
    (with ``mp``, bf16 compute: torch's bits, and the fp32 reference within bf16's tolerance)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp")) if tp \
        else init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    dp = mesh["dp"]
    placement = dict(shard_placement_fn=lambda p: Shard(min(dim, p.dim() - 1))) if dim else {}
    ours, theirs = dict(placement), dict(placement)
    if mp:
        ours["mp_policy"] = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        theirs["mp_policy"] = TorchMP(param_dtype=torch.bfloat16)
    tol = dict(atol=2e-2, rtol=2e-2) if mp else {}
    torch.manual_seed(0)
    models = {"ref": Net(RoundedLinear)}
    with environ(CPU_COLLECTIVES_ENV, transport):
        models["fsdp2"] = _shard(_build(mesh, tp), fsdp2.fully_shard, dp, **ours)
    models["torch"] = _shard(_build(mesh, tp), torch_fully_shard, dp, **theirs)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for name, m in models.items()}
    calls = {}
    dp_rank = dp.get_local_rank()
    for step in range(steps):
        # The TP ranks of one data-parallel rank see its batch.
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 * step + dp_rank))
        losses = {}
        for name, model in models.items():
            Bf16Gathered.calls = []
            losses[name] = model(x).square().mean()
            losses[name].backward()
            calls[name] = Bf16Gathered.calls
        for p in models["ref"].parameters():  # every rank's gradient: each dp batch counted tp times
            dist.all_reduce(p.grad)
            p.grad /= world
        named = {name: dict(m.named_parameters()) for name, m in models.items()}
        for pname, ref in named["ref"].items():
            ours, theirs = _plain(named["fsdp2"][pname].grad), _plain(named["torch"][pname].grad)
            assert type(named["fsdp2"][pname].grad) is DTensor, (pname, type(named["fsdp2"][pname].grad))
            torch.testing.assert_close(ours, ref.grad, **tol, msg=lambda m: f"step {step} {pname} grad: {m}")
            torch.testing.assert_close(ours, theirs, atol=0, rtol=0, msg=lambda m: f"step {step} {pname}: {m}")
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
        for pname, ref in named["ref"].items():
            ours = _plain(named["fsdp2"][pname].detach())
            torch.testing.assert_close(ours, _plain(named["torch"][pname].detach()), atol=0, rtol=0)
            if not mp:  # (AdamW amplifies bf16 compute's drift from the fp32 reference: torch's bits only)
                torch.testing.assert_close(ours, ref.detach(), msg=lambda m: f"step {step} {pname}: {m}")
        torch.testing.assert_close(losses["fsdp2"], losses["torch"], atol=0, rtol=0)
        torch.testing.assert_close(losses["fsdp2"].float(), losses["ref"], **tol)
    sharded = models["fsdp2"].blocks[0][0].weight
    # Each hook's calls in order (the two hooks' interleave as prefetching orders the gathers).
    calls = {name: {hook: [c[1:] for c in got if c[0] == hook] for hook in ("pre", "post")}
             for name, got in calls.items()}
    return {"calls": calls, "local": type(sharded._local_tensor).__name__, "placements": tuple(sharded.placements)}


@pytest.mark.parametrize("transport", ["flat", "exchange"])
def test_tensor_parallel_2x2_matches_torch_and_the_reference(transport):
    for r in run_on_ranks(_train, 4, True, 0, transport):
        assert r["local"] == "Bf16Gathered", r
        # The hooks got what torch's fully_shard hands them: the FSDP shard of the TP-local
        # (8, 16) tensor with outer_size the TP-local shape and the 1-D dp mesh, then the
        # gathered bf16 (8, 16), and from the second gather on the unsharded DTensor as out=.
        assert r["calls"]["fsdp2"] == r["calls"]["torch"], r["calls"]
        assert ((8, 16), (16, 16), 1, 2) in r["calls"]["fsdp2"]["pre"], r["calls"]["fsdp2"]
        assert ((16, 16), "torch.bfloat16", ("DTensor", (32, 16))) in r["calls"]["fsdp2"]["post"]


@pytest.mark.parametrize("transport", ["flat", "exchange", "read"])
def test_dim_1_matches_torch_and_the_reference(transport):
    for r in run_on_ranks(_train, 2, False, 1, transport):
        assert r["local"] == "Bf16Gathered" and r["placements"] == (Shard(1),), r
        # As torch: the (32, 8) shard of a (32, 16) weight gathered as the (64, 8) view of the
        # (32, 16) values laid side by side along dim 1; out= is the unsharded (32, 16) tensor.
        assert r["calls"]["fsdp2"] == r["calls"]["torch"], r["calls"]
        assert ((32, 8), (32, 16), 1, 2) in r["calls"]["fsdp2"]["pre"], r["calls"]["fsdp2"]
        assert ((64, 8), "torch.bfloat16", ("Bf16Gathered", (32, 16))) in r["calls"]["fsdp2"]["post"]


def test_tensor_parallel_mixed_precision_passes_param_dtype_to_the_rebuild():
    for r in run_on_ranks(_train, 4, True, 0, "flat", steps=2, mp=True):
        assert r["calls"]["fsdp2"] == r["calls"]["torch"], r["calls"]
        # The rebuild computes in bf16: out= is the bf16 unsharded DTensor.
        assert r["calls"]["fsdp2"]["post"] and all(c[1] == "torch.bfloat16" for c in r["calls"]["fsdp2"]["post"])


def test_tensor_parallel_sharded_on_dim_1():
    run_on_ranks(_train, 4, True, 1, "flat", steps=2)



def _dp_mesh_dims(impl: str) -> dict:
    """``dp_mesh_dims``: every parameter a DTensor on the whole (dp, tp) mesh (TP on "tp",
    Replicate on "dp"), the weights' local tensors ``Bf16Gathered``; fsdp2 or torch shards it."""
    from tests.parallel.test_spmd_mesh import _MLP, _TP, TorchDims, _loss
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _MLP()
    for name, p in list(model.named_parameters()):
        placements = [_TP[name] if axis == "tp" else Replicate() for axis in mesh.mesh_dim_names]
        d = distribute_tensor(p.detach(), mesh, placements)
        if name.endswith("weight"):
            d = DTensor.from_local(Bf16Gathered(d.to_local().clone()), mesh, placements, run_check=False,
                                   shape=d.shape, stride=d.stride())
        owner, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        setattr(owner, attr, nn.Parameter(d))
    if impl == "fsdp2":
        fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=fsdp2.DataParallelMeshDims(shard="dp"))
    else:  # (torch compares meshes by identity: the parameters' own)
        torch_fully_shard(model, mesh=model.up.weight.device_mesh, dp_mesh_dims=TorchDims(shard="dp"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    Bf16Gathered.calls = []
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + mesh.get_local_rank("dp")))
        loss = _loss(model, mesh, x, "dp")
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "params": {n: _plain(p.detach()) for n, p in model.named_parameters()},
            "hooks": sorted({c[0] for c in Bf16Gathered.calls})}


def test_dp_mesh_dims_with_tensor_parallel_matches_torch():
    from tests._torch import HAS_DATA_PARALLEL_MESH_DIMS

    if not HAS_DATA_PARALLEL_MESH_DIMS:
        pytest.skip("torch's fully_shard has no dp_mesh_dims before 2.13")
    ours, theirs = run_on_ranks(_dp_mesh_dims, 4, "fsdp2"), run_on_ranks(_dp_mesh_dims, 4, "torch")
    for a, b in zip(ours, theirs):
        assert a["hooks"] == ["post", "pre"], a["hooks"]
        torch.testing.assert_close(a["losses"], b["losses"], atol=0, rtol=0)
        for name, value in a["params"].items():
            torch.testing.assert_close(value, b["params"][name], atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


# ---- what stays refused ---------------------------------------------------------------------
class GathersAScale(Bf16Gathered):
    """Gathers one scale per shard beside its values: an input of another size than the shard."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._data.to(torch.bfloat16), self._data.abs().amax().reshape(1)), None


def _errors() -> dict[str, str]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    on_dim_1 = dict(shard_placement_fn=lambda p: Shard(p.dim() - 1))
    found = {}
    # Sharded unevenly on dim 1 (9 columns on 2 ranks): refused before any change, as torch does.
    for name, fully_shard in (("fsdp2", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        model = nn.Linear(9, DIM)
        model.weight = nn.Parameter(Bf16Gathered(model.weight.detach().clone()))
        before = dict(model.named_parameters())
        with pytest.raises((ValueError, NotImplementedError)) as info:
            fully_shard(model, mesh=mesh, **on_dim_1)
        assert dict(model.named_parameters()) == before and not isinstance(model.weight, DTensor)
        found[f"uneven_{name}"] = f"{info.type.__name__}: {info.value}"
    # An input of another size than the shard, sharded on dim 1: refused at the first gather.
    model = nn.Linear(DIM, DIM)
    model.weight = nn.Parameter(GathersAScale(model.weight.detach().clone()))
    fsdp2.fully_shard(model, mesh=mesh, **on_dim_1)
    with pytest.raises(ValueError) as info:
        model(torch.randn(2, DIM))
    found["input_size"] = str(info.value)
    return found


def test_what_stays_unsupported_gets_clear_errors():
    for e in run_on_ranks(_errors, 2):
        assert e["uneven_fsdp2"].startswith("ValueError") and "dim 1 of size 9" in e["uneven_fsdp2"] \
            and "Shard(0)" in e["uneven_fsdp2"], e
        assert e["uneven_torch"].startswith("NotImplementedError") and "uneven" in e["uneven_torch"], e
        assert "GathersAScale" in e["input_size"] and "(16, 8)" in e["input_size"] \
            and "as many elements as the shard" in e["input_size"], e["input_size"]
