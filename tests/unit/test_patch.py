"""``fsdp2.patch_torch()``: torch's FSDP2 names become fsdp2's, and undoing puts back exactly
torch's objects.

Inside the patch a model sharded through ``torch.distributed.fsdp.fully_shard`` is an fsdp2
module (``isinstance`` with torch's name says so) and trains bit for bit like one sharded
with ``fsdp2.fully_shard`` and like torch's own ``fully_shard`` held from before the patch
(torch's implementation keeps working for whoever holds it), and like the unsharded reference.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.runtime._state import get_state
from tests._dist import run_on_ranks
from tests._models import Transformer, train
from tests._parity import train_parity

NAMES = ("fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy",
         "CPUOffloadPolicy", "register_fsdp_forward_method", "DataParallelMeshDims", "share_comm_ctx")
NAMESPACES = ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard",
              "torch.distributed.fsdp._fully_shard._fully_shard", "torch.distributed.fsdp._fully_shard._fsdp_api",
              "torch.distributed._composable.fsdp", "torch.distributed._composable.fsdp.fully_shard")


def _snapshot() -> dict:
    """Every FSDP2 name each namespace has, as attribute and in its __dict__, and its class."""
    out = {}
    for ns in NAMESPACES:
        module = importlib.import_module(ns)
        out[ns] = {"class": type(module),
                   "attrs": {n: getattr(module, n) for n in NAMES if n in vars(module)},
                   "dict": {n: vars(module)[n] for n in NAMES if n in vars(module)}}
    return out


def _fake_module(name: str, **names) -> types.ModuleType:
    module = types.ModuleType(name)
    vars(module).update(names)
    sys.modules[name] = module
    return module


@pytest.fixture
def client():
    """A module that did ``from torch.distributed.fsdp import fully_shard, FSDPModule`` before the patch."""
    import torch.distributed.fsdp as torch_fsdp
    module = _fake_module("_fsdp2_test_client", fully_shard=torch_fsdp.fully_shard, FSDPModule=torch_fsdp.FSDPModule,
                          MixedPrecisionPolicy=torch_fsdp.MixedPrecisionPolicy, unrelated=torch_fsdp)
    yield module
    del sys.modules["_fsdp2_test_client"]


def test_patch_replaces_every_name_and_undo_restores_the_same_objects(client):
    before = _snapshot()
    assert all(len(s["attrs"]) >= 3 for s in before.values())  # each namespace holds some of the names
    torch_fsdp = importlib.import_module("torch.distributed.fsdp")
    assert before["torch.distributed.fsdp"]["attrs"].keys() == {n for n in NAMES if hasattr(torch_fsdp, n)}
    assert {n for n in NAMES if hasattr(torch_fsdp, n)} >= set(NAMES) - {"DataParallelMeshDims"}  # new in 2.13
    handle = fsdp2.patch_torch()
    try:
        for ns, snap in before.items():
            module = sys.modules[ns]
            for name in snap["attrs"]:
                assert getattr(module, name) is getattr(fsdp2, name), (ns, name)
            assert {n: vars(module)[n] for n in snap["dict"]} == snap["dict"], "torch's globals stay torch's"
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy
        assert (fully_shard, FSDPModule, MixedPrecisionPolicy) == (
            fsdp2.fully_shard, fsdp2.FSDPModule, fsdp2.MixedPrecisionPolicy)
        # Already imported elsewhere: rebound; other names left alone.
        assert client.fully_shard is fsdp2.fully_shard and client.FSDPModule is fsdp2.FSDPModule
        assert client.MixedPrecisionPolicy is fsdp2.MixedPrecisionPolicy
        assert client.unrelated is sys.modules["torch.distributed.fsdp"]
    finally:
        handle.undo()
    after = _snapshot()
    for ns, snap in before.items():
        assert after[ns]["class"] is snap["class"] is types.ModuleType
        for name, obj in snap["attrs"].items():
            assert after[ns]["attrs"][name] is obj, (ns, name)
            assert after[ns]["dict"][name] is obj, (ns, name)
    import torch.distributed.fsdp as torch_fsdp
    assert client.fully_shard is torch_fsdp.fully_shard is not fsdp2.fully_shard
    assert client.FSDPModule is torch_fsdp.FSDPModule and not handle.active


def test_context_manager_nesting_and_double_undo(client):
    import torch.distributed.fsdp as torch_fsdp
    original = torch_fsdp.fully_shard
    with fsdp2.patch_torch() as outer:
        inner = fsdp2.patch_torch()
        assert torch_fsdp.fully_shard is fsdp2.fully_shard
        inner.undo()
        inner.undo()  # a second undo of the same handle does nothing
        assert torch_fsdp.fully_shard is fsdp2.fully_shard, "the outer patch is still in force"
        with fsdp2.patch_torch():
            assert client.fully_shard is fsdp2.fully_shard
        assert client.fully_shard is fsdp2.fully_shard and outer.active
    assert torch_fsdp.fully_shard is original and client.fully_shard is original
    outer.undo()
    assert torch_fsdp.fully_shard is original


def test_undo_after_an_exception_inside():
    import torch.distributed.fsdp as torch_fsdp
    original = torch_fsdp.FSDPModule
    with pytest.raises(RuntimeError, match="boom"):
        with fsdp2.patch_torch():
            raise RuntimeError("boom")
    assert torch_fsdp.FSDPModule is original


def test_names_rebound_meanwhile_and_imports_made_while_patched(client):
    import torch.distributed.fsdp as torch_fsdp
    original = torch_fsdp.fully_shard
    mine = object()
    with fsdp2.patch_torch():
        client.FSDPModule = mine  # the user's own rebinding wins over the undo
        late = _fake_module("_fsdp2_test_late", fully_shard=torch_fsdp.fully_shard)  # what an import gets now
        torch_late = _fake_module("torch._fsdp2_test_late", fully_shard=torch_fsdp.fully_shard)
    try:
        assert client.FSDPModule is mine and client.fully_shard is original
        assert late.fully_shard is fsdp2.fully_shard, "imported while patched: keeps fsdp2's (documented)"
        assert torch_late.fully_shard is original, "torch's own modules imported while patched are put back"
    finally:
        del sys.modules["_fsdp2_test_late"], sys.modules["torch._fsdp2_test_late"]


# ---- on a live world ----------------------------------------------------------------------
def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _train(shard, steps: int = 3) -> list[torch.Tensor]:
    model = shard(Transformer())
    losses = train(model, steps)
    with torch.no_grad():
        return losses, {n: p.full_tensor() for n, p in model.named_parameters()}


def _blocks_then_root(fully_shard, mp_policy=None):
    def shard(model):
        kwargs = {"mesh": _mesh()} if mp_policy is None else {"mesh": _mesh(), "mp_policy": mp_policy}
        for block in model.layers:
            fully_shard(block, **kwargs)
        return fully_shard(model, **kwargs)
    return shard


def _patched_training() -> dict:
    import torch.distributed.fsdp as torch_fsdp
    torch_fully_shard, TorchFSDPModule = torch_fsdp.fully_shard, torch_fsdp.FSDPModule  # held from before
    out = {"torch": _train(_blocks_then_root(torch_fully_shard)),
           "fsdp2": _train(_blocks_then_root(fsdp2.fully_shard))}
    with fsdp2.patch_torch():
        from torch.distributed._composable.fsdp import FSDPModule as ComposableFSDPModule
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy()  # constructed while patched: fsdp2's
        model = _blocks_then_root(fully_shard, policy)(Transformer())
        out["is_fsdp2"] = (isinstance(model, fsdp2.FSDPModule) and isinstance(model, FSDPModule)
                           and isinstance(model.layers[0], ComposableFSDPModule)
                           and get_state(model.layers[0]) is not None)
        # torch's implementation still works for a caller holding it: a torch module, not ours.
        held = _blocks_then_root(torch_fully_shard)(Transformer())
        out["held_is_torch"] = isinstance(held, TorchFSDPModule) and not isinstance(held, FSDPModule)
        out["patched"] = _train(_blocks_then_root(fully_shard, policy))
        train_parity(Transformer, _blocks_then_root(fully_shard))  # against the unsharded reference
    out["torch_after"] = _train(_blocks_then_root(torch_fsdp.fully_shard))
    return {k: (v if isinstance(v, bool) else (torch.stack(v[0]), v[1])) for k, v in out.items()}


def test_sharding_through_torchs_name_is_fsdp2_and_trains_like_it():
    for r in run_on_ranks(_patched_training, 2):
        assert r["is_fsdp2"] and r["held_is_torch"]
        for other in ("fsdp2", "torch", "torch_after"):
            assert torch.equal(r["patched"][0], r[other][0]), (other, r["patched"][0], r[other][0])
            assert all(torch.equal(p, r[other][1][n]) for n, p in r["patched"][1].items()), other
