"""The drop-in promise: same names, signatures and defaults as torch's FSDP2, same training.

Switching ``from torch.distributed.fsdp import fully_shard`` to ``from fsdp2 import
fully_shard`` must change nothing a user can call or observe.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2
from tests._dist import run_on_ranks
from tests._models import MLP, Transformer, train
from tests._parity import train_parity
from tests._torch import HAS_DATA_PARALLEL_MESH_DIMS, TORCH_VERSION

PUBLIC_NAMES = {
    "fully_shard", "fully_shard_auto", "patch_torch", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy",
    "OffloadPolicy", "CPUOffloadPolicy", "register_fsdp_forward_method", "record_schedule", "clip_grad_norm_",
    "MemoryTracker", "estimate_memory", "share_comm_ctx", "AllGather", "ReduceScatter",
    "DataParallelMeshDims", "QuantizedComm", "count_comm_bytes", "CommBytes",
}
# torch's FSDP2 names fsdp2 does not provide: none.
TORCH_ONLY_NAMES: set[str] = set()
# Every public method of torch's FSDPModule (fsdp2's extra ones aside): same names, same signatures.
FSDP_MODULE_METHODS = sorted(
    name for name, value in vars(torch_fsdp.FSDPModule).items() if callable(value) and not name.startswith("_")
)


def _comparable(value):
    """A default value, made comparable across the two packages' policy classes."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value).__name__, dataclasses.asdict(value)
    return value


def _params(fn) -> list[tuple[str, inspect._ParameterKind, object]]:
    """Names, kinds and defaults; annotations differ in spelling only, so they are left out."""
    return [(p.name, p.kind, _comparable(p.default)) for p in inspect.signature(fn).parameters.values()]


# ---- names and signatures (no process group needed) ---------------------------------------
def test_all_lists_exactly_the_public_names():
    assert set(fsdp2.__all__) == PUBLIC_NAMES and len(fsdp2.__all__) == len(PUBLIC_NAMES)
    assert all(hasattr(fsdp2, name) for name in fsdp2.__all__)
    torch_fsdp2_names = set(torch_fsdp._fully_shard.__all__)
    # Every other FSDP2 name torch exports is here; the rest are fsdp2's own (torch 2.13's surface:
    # an older torch lacks some of it, e.g. 2.11 has no DataParallelMeshDims).
    ours = PUBLIC_NAMES - {
        "fully_shard_auto", "patch_torch", "record_schedule", "clip_grad_norm_", "MemoryTracker", "estimate_memory",
        "AllGather", "ReduceScatter",  # torch keeps its comm base classes in a private module
        "QuantizedComm", "count_comm_bytes", "CommBytes"}  # quantized communication and its measure: fsdp2's own
    if TORCH_VERSION >= (2, 13):
        assert torch_fsdp2_names - TORCH_ONLY_NAMES == ours
    else:
        assert torch_fsdp2_names - TORCH_ONLY_NAMES <= ours


def test_fully_shard_signature_matches_torch():
    ours = _params(fsdp2.fully_shard)
    theirs = _params(torch_fsdp.fully_shard)
    assert ours[:len(theirs)] == theirs  # an older torch's arguments are a prefix (2.11: no dp_mesh_dims)
    # fsdp2's own arguments come after torch's, keyword-only with a default that changes nothing.
    own = [("comm_policy", inspect.Parameter.KEYWORD_ONLY, None)]
    if TORCH_VERSION >= (2, 13):
        assert ours == theirs + own
    assert [name for name, kind, _ in ours if kind is inspect.Parameter.KEYWORD_ONLY] == [
        "mesh", "reshard_after_forward", "shard_placement_fn", "mp_policy", "offload_policy",
        "ignored_params", "dp_mesh_dims", "comm_policy",
    ]


@pytest.mark.parametrize("name", ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"])
def test_policy_fields_and_defaults_match_torch(name):
    ours, theirs = getattr(fsdp2, name), getattr(torch_fsdp, name)

    def fields(cls):
        return [(f.name, f.default) for f in dataclasses.fields(cls)]

    assert fields(ours) == fields(theirs)
    # Frozen-ness may differ: fsdp2's policies are all frozen (torch's OffloadPolicy is not).
    assert dataclasses.asdict(ours()) == dataclasses.asdict(theirs())
    assert issubclass(fsdp2.CPUOffloadPolicy, fsdp2.OffloadPolicy)


@pytest.mark.skipif(not HAS_DATA_PARALLEL_MESH_DIMS, reason=f"torch {torch.__version__} has no DataParallelMeshDims")
def test_data_parallel_mesh_dims_matches_torch():
    ours, theirs = fsdp2.DataParallelMeshDims, torch_fsdp.DataParallelMeshDims
    assert [(f.name, f.default) for f in dataclasses.fields(ours)] == \
        [(f.name, f.default) for f in dataclasses.fields(theirs)]
    for kwargs in ({"shard": "dp"}, {"shard": ("a", "b"), "replicate": "r"}, {"replicate": "r"}):
        a, b = ours(**kwargs), theirs(**kwargs)
        assert (a.shard_names, a.replicate_names) == (b.shard_names, b.replicate_names)
    with pytest.raises(ValueError):
        theirs()
    with pytest.raises(ValueError, match="set at least one of shard and replicate"):
        ours()
    with pytest.raises(TypeError, match="DataParallelMeshDims.shard must be a mesh axis name"):
        ours(shard=0)


def test_fsdp_module_has_every_method_of_torchs():
    assert len(FSDP_MODULE_METHODS) >= 15  # the scan found torch's methods (18 in torch 2.11, 22 in 2.13)
    assert [m for m in FSDP_MODULE_METHODS if not hasattr(fsdp2.FSDPModule, m)] == []


@pytest.mark.parametrize("method", FSDP_MODULE_METHODS)
def test_fsdp_module_method_matches_torch(method):
    assert _params(getattr(fsdp2.FSDPModule, method)) == _params(getattr(torch_fsdp.FSDPModule, method))


def test_package_never_imports_torch_fsdp():
    """Except fsdp2/patch.py, whose job is to replace torch's names (tests/unit/test_patch.py)."""
    offenders = []
    patch = Path(fsdp2.__file__).parent / "patch.py"
    for path in sorted(Path(fsdp2.__file__).parent.rglob("*.py")):
        if path == patch:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                modules = [base] + [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)) \
                    and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
                modules = [a.value for a in node.args if isinstance(a, ast.Constant)]
            else:
                continue
            if any(m == "torch.distributed.fsdp" or m.startswith("torch.distributed.fsdp.")
                   for m in modules if isinstance(m, str)):
                offenders.append(f"{path.name}:{node.lineno}")
    assert len(list(Path(fsdp2.__file__).parent.glob("*.py"))) > 5  # the scan saw the package
    assert offenders == []


def test_import_loads_the_core_only_and_the_tools_on_first_use():
    """``import fsdp2`` loads the runtime, not the planner, the Llama model (with torch's
    tensor-parallel styles) or the checkpoint helpers; their names still work from the package.
    ``import fsdp2.checkpoint``, and the recipe a launch runs, leave out torch.distributed.checkpoint
    until a DCP helper is first used; every checkpoint name answers from its one home."""
    import subprocess
    import sys

    tools = ("fsdp2.memory", "fsdp2.models", "fsdp2.checkpoint", "fsdp2.plan", "torch.distributed.tensor.parallel")
    code = f"""
import sys
import fsdp2
loaded = sorted(m for m in sys.modules if m.startswith({tools!r}))
assert not loaded, loaded
import fsdp2.checkpoint
import recipes.train
assert "torch.distributed.checkpoint" not in sys.modules
from fsdp2.checkpoint import Snapshotter, is_hf_folder
assert is_hf_folder.__module__ == "fsdp2.models.hf_config" and "torch.distributed.checkpoint" not in sys.modules
assert set(fsdp2.checkpoint.__all__) <= set(dir(fsdp2.checkpoint))
homes = sorted(set(getattr(fsdp2.checkpoint, name).__module__ for name in fsdp2.checkpoint.__all__
                   if name != "ASYNC_MODES"))  # (ASYNC_MODES: a tuple, it has no __module__)
assert homes == [*("fsdp2.checkpoint._" + m for m in ("async", "dcp", "full", "hf", "snapshot")),
                 "fsdp2.models.hf_config"], homes
assert fsdp2.checkpoint.Snapshotter is Snapshotter and "torch.distributed.checkpoint" in sys.modules
try:
    fsdp2.checkpoint.no_such_name
except AttributeError as e:
    assert "fsdp2.checkpoint" in str(e) and "no_such_name" in str(e)
else:
    raise AssertionError("no AttributeError")
from fsdp2 import MemoryTracker, estimate_memory
assert MemoryTracker.__module__ == "fsdp2.memory._tracker" and callable(estimate_memory)
assert fsdp2.memory.MemoryTracker is MemoryTracker and fsdp2.checkpoint.save
assert "estimate_memory" in dir(fsdp2)
try:
    fsdp2.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("no AttributeError")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])  # the repository's fsdp2 and recipes
    assert out.returncode == 0, out.stderr


def test_the_planners_names_live_in_fsdp2_plan_and_still_answer_in_fsdp2_memory():
    """One home each: fsdp2.plan defines them; fsdp2.memory forwards the same objects, warning."""
    import warnings

    import fsdp2.memory
    import fsdp2.plan

    moved = sorted(fsdp2.memory._MOVED_TO_PLAN)
    assert set(moved) <= set(fsdp2.plan.__all__) and not set(moved) & set(fsdp2.memory.__all__)
    for name in moved:
        assert name == "HARDWARE" or getattr(fsdp2.plan, name).__module__.startswith("fsdp2.plan."), name
        with pytest.warns(DeprecationWarning, match=rf"fsdp2.memory.{name} moved to fsdp2.plan: use `from "
                                                    rf"fsdp2.plan import {name}`"):
            assert getattr(fsdp2.memory, name) is getattr(fsdp2.plan, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fsdp2.estimate_memory is fsdp2.plan.estimate_memory
        from fsdp2.memory import MemoryTracker  # the tracker's own names: no warning
    assert MemoryTracker is fsdp2.MemoryTracker
    with pytest.raises(AttributeError, match="module 'fsdp2.memory' has no attribute 'check_fit'"):
        fsdp2.memory.check_fit  # noqa: B018


# ---- behaviour on a live world -------------------------------------------------------------
def _module_identity(impl_name):
    impl = importlib.import_module(impl_name)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    returned = impl.fully_shard(model, mesh=mesh)
    sliced = model[:2]
    return {
        "returned_is_module": returned is model,
        "is_fsdp_module": isinstance(model, impl.FSDPModule),
        "still_sequential": isinstance(model, nn.Sequential),
        "class_name": type(model).__name__,
        "sliced_class": type(sliced).__name__,
        "sliced_is_fsdp": isinstance(sliced, impl.FSDPModule),
        "sliced_shares_children": sliced[0] is model[0],
    }


def test_fully_shard_returns_the_module_as_fsdp_subclass():
    ours = run_on_ranks(_module_identity, 2, "fsdp2")[0]
    assert ours == run_on_ranks(_module_identity, 2, "torch.distributed.fsdp")[0]
    assert ours == {
        "returned_is_module": True,
        "is_fsdp_module": True,
        "still_sequential": True,
        "class_name": "FSDPSequential",
        # nn.Sequential slicing builds ``type(self)(...)``: the slice is a plain Sequential.
        "sliced_class": "Sequential",
        "sliced_is_fsdp": False,
        "sliced_shares_children": True,
    }


class _Sized(nn.Module):
    def __init__(self, n: int, *, bias: bool = True) -> None:
        super().__init__()
        self.n = n
        self.lin = nn.Linear(n, n, bias=bias)


def _building_from_a_sharded_class(impl_name):
    """``type(sharded)(...)`` builds a plain, unsharded module of the user's class, with the
    arguments given (what containers do); FSDPModule itself is not built directly (fsdp2)."""
    impl = importlib.import_module(impl_name)
    model = impl.fully_shard(_Sized(4), mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    built = type(model)(6, bias=False)
    said = ""
    if impl_name == "fsdp2":
        with pytest.raises(TypeError) as info:
            impl.FSDPModule()
        said = str(info.value)
    return [type(built).__name__, built.n, built.lin.bias is None, isinstance(built.lin.weight, DTensor), said]


def test_calling_a_sharded_class_builds_the_users_class():
    ours = run_on_ranks(_building_from_a_sharded_class, 2, "fsdp2")
    theirs = run_on_ranks(_building_from_a_sharded_class, 2, "torch.distributed.fsdp")
    assert [r[:4] for r in ours] == [r[:4] for r in theirs] == [["_Sized", 6, True, False]] * 2
    assert ours[0][4] == "FSDPModule is not made directly: fully_shard(module) makes a module one"


def _train_three_steps(fully_shard, model: nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The user's training code; only the ``fully_shard`` it is handed differs."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = [loss.item() for loss in train(model, 3)]
    return losses, {n: p.full_tensor() for n, p in model.named_parameters()}


def _switch_by_one_import():
    model = Transformer()
    torch_losses, torch_params = _train_three_steps(torch_fsdp.fully_shard, copy.deepcopy(model))
    losses, params = _train_three_steps(fsdp2.fully_shard, copy.deepcopy(model))
    assert params.keys() == torch_params.keys()
    for name, p in params.items():
        torch.testing.assert_close(p, torch_params[name], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    return torch_losses, losses


def test_switching_the_import_gives_the_same_training():
    for torch_losses, losses in run_on_ranks(_switch_by_one_import, 2):
        assert len(losses) == 3
        torch.testing.assert_close(losses, torch_losses, atol=1e-5, rtol=1e-5)


def _dense_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _default_mesh():
    meshes = []

    def shard(model):
        fsdp2.fully_shard(model)  # mesh=None: the default process group's world
        meshes.extend(p.device_mesh for p in model.parameters())

    train_parity(lambda: MLP(8, 16), shard, batch=_dense_batch, loss_fn=F.mse_loss)
    return [(m.device_type, m.mesh.tolist()) for m in meshes]


def test_mesh_none_uses_the_default_world():
    for meshes in run_on_ranks(_default_mesh, 2):
        assert meshes == [("cpu", [0, 1])] * 4
