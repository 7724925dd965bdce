"""``torch.save`` / ``pickle`` / ``copy.deepcopy`` of sharded models, parameters and optimizer
state, against torch's own ``fully_shard`` on the same layout in the same test.

Every layout (FSDP, HSDP, FSDP x TP, mixed precision, CPU offload) on 2 and 4 gloo ranks: a
model state dict, a detached parameter, a parameter and an optimizer state dict are pickled
and loaded back three ways (``pickle``, ``torch.load`` with ``weights_only`` True and False).
What comes back is compared with what was saved and with what torch's FSDP2 saves: the same
outcome, the same types, DTensor placements and meshes, local tensors equal and of the same
storage size (both pickle only the padded shard). Training goes on after the saves, the shards
still views of the group's packed buffer.
"""

from __future__ import annotations

import copy
import functools
import io
import pickle
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp2
from fsdp2._common import STATE_ATTR
from tests._dist import run_on_ranks

VOCAB, DIM, HIDDEN = 13, 8, 12  # 13 rows: uneven over 2 and 4 ranks (padding, a short last shard)
LAYOUTS = ("fsdp", "hsdp", "tp", "mixed_precision", "offload")
HOWS = ("pickle", "torch.load", "torch.load(weights_only=True)")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.silu(self.w1(self.norm(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.emb = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList(_Block() for _ in range(2))
            self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@functools.cache
def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    # Cached per rank process: every rank makes the same meshes in the same order.
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _build(layout: str, impl: str) -> nn.Module:
    """``_Net`` sharded by fsdp2 (``impl="fsdp2"``) or torch's FSDP2 on ``layout``: blocks, then root."""
    world = dist.get_world_size()
    shard = fsdp2.fully_shard if impl == "fsdp2" else torch_fully_shard
    kwargs: dict[str, Any] = {}
    model = _Net()
    if layout == "hsdp":  # a 2-D mesh: replicate over the outer axis, shard over 2 ranks
        kwargs["mesh"] = _mesh((world // 2, 2), ("replicate", "shard"))
    elif layout == "tp":  # FSDP over 2 ranks x TP over the rest (a TP axis of 1 on 2 ranks)
        mesh = _mesh((2, world // 2), ("dp", "tp"))
        for block in model.layers:
            parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        kwargs["mesh"] = mesh["dp"]
    else:
        kwargs["mesh"] = _mesh((world,), ("dp",))
    if layout == "mixed_precision":
        policy = fsdp2.MixedPrecisionPolicy if impl == "fsdp2" else TorchPolicy
        kwargs["mp_policy"] = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if layout == "offload":
        policy = fsdp2.CPUOffloadPolicy if impl == "fsdp2" else TorchOffload
        kwargs["offload_policy"] = policy(pin_memory=False)
    for block in model.layers:
        shard(block, **kwargs)
    return shard(model, **kwargs)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (2, 6), generator=gen)
    F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten()).backward()
    opt.step()
    opt.zero_grad()


def _trained(layout: str) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
    out = {}
    for impl in ("fsdp2", "torch"):
        model = _build(layout, impl)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _step(model, opt, 0)
        out[impl] = model, opt
    return out


def _reload(obj: Any, how: str) -> tuple[str, Any]:
    """``obj`` pickled and loaded back ``how``: ``("ok", copy)`` or ``("error", exception type name)``."""
    try:
        if how == "pickle":
            return "ok", pickle.loads(pickle.dumps(obj))
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return "ok", torch.load(buf, weights_only=how.endswith("=True)"))
    except Exception as e:  # compared with torch's outcome: both must fail alike
        return "error", type(e).__name__


def _leaves(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [leaf for key, value in obj.items() for leaf in _leaves(value, f"{path}/{key}")]
    if isinstance(obj, (list, tuple)):
        return [leaf for i, value in enumerate(obj) for leaf in _leaves(value, f"{path}/{i}")]
    return [(path, obj)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _assert_same_tensor(path: str, loaded: torch.Tensor, saved: torch.Tensor) -> None:
    assert type(loaded) is type(saved), (path, type(loaded), type(saved))
    assert loaded.requires_grad == saved.requires_grad, path
    if isinstance(saved, DTensor):
        assert loaded.placements == saved.placements, (path, loaded.placements, saved.placements)
        assert loaded.device_mesh == saved.device_mesh, path
        assert loaded.shape == saved.shape, path
    torch.testing.assert_close(_local(loaded), _local(saved), atol=0, rtol=0, msg=path)


def _check_round_trip(name: str, objs: dict[str, Any], how: str) -> str:
    """``objs[impl]``: the same thing from fsdp2 and from torch's FSDP2, saved and loaded ``how``;
    returns the outcome (``"ok"``, or the exception type both raised)."""
    outcome = {impl: _reload(obj, how) for impl, obj in objs.items()}
    kinds = {impl: out if out[0] == "error" else ("ok",) for impl, out in outcome.items()}
    assert kinds["fsdp2"] == kinds["torch"], (name, how, kinds)
    if outcome["torch"][0] == "error":
        return outcome["torch"][1]
    leaves = {impl: _leaves(outcome[impl][1]) for impl in objs}
    saved = _leaves(objs["fsdp2"])
    assert [path for path, _ in leaves["fsdp2"]] == [path for path, _ in leaves["torch"]] == [p for p, _ in saved]
    for (path, mine), (_, theirs), (_, before) in zip(leaves["fsdp2"], leaves["torch"], saved):
        if not isinstance(before, torch.Tensor):
            assert mine == before == theirs, (name, how, path)
            continue
        _assert_same_tensor(f"{name} {how} {path}", mine, before)  # fsdp2's: what was saved
        assert type(mine) is type(theirs), (path, type(mine), type(theirs))  # as torch's
        torch.testing.assert_close(_local(mine), _local(theirs), atol=0, rtol=0, msg=f"{name} {how} {path} vs torch")
        # Both pickle a shard's own bytes (the padded shard), not a buffer it is a view of.
        assert _local(mine).untyped_storage().nbytes() == _local(theirs).untyped_storage().nbytes(), path
    return "ok"


def _groups(model: nn.Module) -> list:
    states = {id(s): s for m in model.modules() if (s := getattr(m, STATE_ATTR, None)) is not None}
    return [s.group for s in states.values() if s.group is not None]


def _assert_shards_in_packed_buffers(model: nn.Module) -> int:
    """Each packed group's shards still live in its packed buffer; returns how many groups pack."""
    packed = 0
    for group in _groups(model):
        buffer = group._packed
        if buffer is None:
            continue
        packed += 1
        start, stop = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
        for p in group.params:
            local = p.sharded._local_tensor
            assert start <= local.data_ptr() < stop or local.numel() == 0, p.fqn
            assert p.padded_local.data_ptr() == local.data_ptr()
    return packed


def _round_trips(layout: str) -> dict[str, str]:
    trained = _trained(layout)
    models = {impl: model for impl, (model, _) in trained.items()}
    opts = {impl: opt for impl, (_, opt) in trained.items()}
    packs = layout in ("fsdp", "hsdp", "tp", "offload")  # mixed precision casts: no packed buffer
    assert bool(_assert_shards_in_packed_buffers(models["fsdp2"])) == packs
    params = {impl: dict(m.named_parameters()) for impl, m in models.items()}
    names = list(params["fsdp2"])
    assert names == list(params["torch"])
    outcomes = {}
    for how in HOWS:
        outcomes[f"state_dict {how}"] = _check_round_trip(
            "state_dict", {impl: m.state_dict() for impl, m in models.items()}, how)
        outcomes[f"optimizer {how}"] = _check_round_trip(
            "optimizer", {impl: o.state_dict() for impl, o in opts.items()}, how)
        for name in (names[0], names[-1]):  # a first and a last parameter of a group's buffer
            outcomes[f"detach() {how}"] = _check_round_trip(
                f"{name}.detach()", {impl: ps[name].detach() for impl, ps in params.items()}, how)
            outcomes[f"parameter {how}"] = _check_round_trip(name, {impl: ps[name] for impl, ps in params.items()}, how)
    # deepcopy of a state dict and of a parameter: a copy, as torch's
    for impl, model in models.items():
        sd = model.state_dict()
        for key, value in copy.deepcopy(sd).items():
            _assert_same_tensor(f"deepcopy {impl} {key}", value, sd[key])
            assert _local(value).data_ptr() != _local(sd[key]).data_ptr() or value.numel() == 0, key
        p = params[impl][names[-1]]
        _assert_same_tensor(f"deepcopy {impl} param", copy.deepcopy(p), p)
    # A saved state dict loads back into the model (values changed meanwhile), and training goes on.
    buf = io.BytesIO()
    torch.save({impl: (m.state_dict(), opts[impl].state_dict()) for impl, m in models.items()}, buf)
    before = {impl: {k: _local(v).clone() for k, v in m.state_dict().items()} for impl, m in models.items()}
    for impl, model in models.items():
        _step(model, opts[impl], 1)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for impl, model in models.items():
        model.load_state_dict(loaded[impl][0])
        opts[impl].load_state_dict(loaded[impl][1])
        for key, value in model.state_dict().items():
            torch.testing.assert_close(_local(value), before[impl][key], atol=0, rtol=0, msg=f"{impl} {key}")
        _step(model, opts[impl], 2)
    for name in names:
        torch.testing.assert_close(_local(params["fsdp2"][name]), _local(params["torch"][name]), atol=0, rtol=0,
                                   msg=name)
    assert bool(_assert_shards_in_packed_buffers(models["fsdp2"])) == packs
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_and_load_round_trip_as_torchs(layout, world):
    for outcomes in run_on_ranks(_round_trips, world, layout, timeout=300):
        # torch's FSDP2 round-trips them all (the weights-only unpickler included): so must fsdp2
        assert outcomes == dict.fromkeys(outcomes, "ok"), outcomes


# ---- copy.deepcopy of a sharded module ----------------------------------------------------
def _deepcopy_refusals() -> dict[str, list[tuple[str, str]]]:
    out = {}
    for impl in ("fsdp2", "torch"):
        model = _build("fsdp", impl)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        errors = []
        for module in (model, model.layers[0], model.layers):  # the root, a block, a plain container of blocks
            with pytest.raises(AssertionError, match="does not support deepcopy") as info:  # torch's type
                copy.deepcopy(module)
            if impl == "fsdp2":  # fsdp2's errors are ValueErrors too (FSDPValueError)
                assert isinstance(info.value, ValueError) and "state_dict" in str(info.value)
            errors.append((type(info.value).__name__, str(info.value)))
        _step(model, opt, 0)  # nothing changed: the model still trains
        out[impl] = errors
    return out


def test_deepcopy_of_a_sharded_module_is_refused_as_torchs():
    for out in run_on_ranks(_deepcopy_refusals, 2):
        assert [kind for kind, _ in out["fsdp2"]] == ["FSDPValueError"] * 3
        assert [kind for kind, _ in out["torch"]] == ["AssertionError"] * 3


# ---- what user code sees of a shard's storage ----------------------------------------------
_SAME_AS_TORCH: dict[str, Callable[[torch.Tensor], Any]] = {
    "param.storage_offset()": lambda p: p.storage_offset(),
    "param.data_ptr()": lambda p: p.data_ptr(),
    "param.is_contiguous()": lambda p: p.is_contiguous(),
    "local.storage_offset()": lambda p: p.to_local().storage_offset(),
    "local.stride()": lambda p: p.to_local().stride(),
    "local.untyped_storage().nbytes()": lambda p: p.to_local().untyped_storage().nbytes(),
    "local starts its storage": lambda p: p.to_local().data_ptr() == p.to_local().untyped_storage().data_ptr(),
    "detach().to_local().storage_offset()": lambda p: p.detach().to_local().storage_offset(),
    "local._base is None": lambda p: p._local_tensor._base is None,
}


def _storage_views() -> dict[str, dict[str, list]]:
    out: dict[str, dict[str, list]] = {}
    for impl in ("fsdp2", "torch"):
        model = _build("fsdp", impl)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _step(model, opt, 0)
        params = list(model.parameters())
        seen = {what: [get(p) for p in params] for what, get in _SAME_AS_TORCH.items()}
        seen["local.untyped_storage().resizable()"] = [p.to_local().untyped_storage().resizable() for p in params]
        # Shards of one group in one allocation (fsdp2) or each its own (torch): whether any two
        # parameters' storages lie back to back in memory.
        ends = {p.to_local().untyped_storage().data_ptr() + p.to_local().untyped_storage().nbytes() for p in params}
        seen["storages back to back"] = [any(p.to_local().untyped_storage().data_ptr() in ends for p in params)]
        # The unsharded parameters (the root's embedding and head after unshard()): views of the
        # group's buffer at their offsets in fsdp2, each its own all-gather output in torch's.
        model.unshard()
        seen["unsharded at offset 0"] = [all(p.storage_offset() == 0 for p in (model.emb.weight, model.head.weight))]
        model.reshard()
        out[impl] = seen
        if impl == "fsdp2":
            assert _assert_shards_in_packed_buffers(model) == 3
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_shard_storage_as_seen_by_user_code(world):
    for out in run_on_ranks(_storage_views, world):
        mine, theirs = out["fsdp2"], out["torch"]
        for what in _SAME_AS_TORCH:
            assert mine[what] == theirs[what], (what, mine[what], theirs[what])
        assert all(offset == 0 for offset in mine["local.storage_offset()"])
        # The differences docs/comparison.md lists: the packed buffer's slots are not resizable
        # (nothing resizes a shard), and a group's shards sit back to back in one allocation.
        assert mine["local.untyped_storage().resizable()"] == [False] * len(mine["local.storage_offset()"])
        assert theirs["local.untyped_storage().resizable()"] == [True] * len(theirs["local.storage_offset()"])
        assert mine["storages back to back"] == [True]
        assert (mine["unsharded at offset 0"], theirs["unsharded at offset 0"]) == ([False], [True])
