"""Bad arguments raise TypeError/ValueError naming the problem and the fix, and change nothing.

Every check in ``fully_shard`` runs before the first change, so after a rejected call the
module must be exactly as it was: same class, same parameter objects (plain tensors, not
DTensors), no hooks, no fsdp2 state.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2 import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from tests._dist import run_on_ranks
from tests._models import MLP
from tests._torch import CHECKS_SHARD_PLACEMENT_TYPE, REFUSES_PARAMS_IN_TWO_GROUPS


# ---- helpers ----------------------------------------------------------------------------
def _snapshot(module: nn.Module) -> list[tuple]:
    """Everything fully_shard could change, per submodule; parameters by identity."""
    return [
        (name, type(m), [(n, id(p), p.__class__) for n, p in m._parameters.items()],
         len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks),
         sorted(k for k in m.__dict__ if "fsdp" in k.lower()))
        for name, m in module.named_modules()
    ]


def _values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in module.named_parameters() if p.device.type != "meta"}


def _expect_rejected(module: nn.Module, call: Callable[[], Any], exc: type[Exception], match: str,
                     *, already_sharded: bool = False) -> None:
    before, values = _snapshot(module), _values(module)
    with pytest.raises(exc, match=match):
        call()
    assert _snapshot(module) == before
    after = _values(module)
    assert after.keys() == values.keys() and all(torch.equal(after[n], v) for n, v in values.items())
    if not already_sharded:
        assert not any(isinstance(m, FSDPModule) for m in module.modules())
        assert not any(isinstance(p, DTensor) for p in module.parameters())


@functools.cache
def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (dist.get_world_size(),))


class WithScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(8)
        self.temperature = nn.Parameter(torch.tensor(1.0))


# ---- cases run on 2 ranks (they need a mesh); name -> (module, call, exception, match) -----
def _case(name: str) -> tuple[nn.Module, Callable[[], Any], type[Exception], str]:
    mlp = MLP(8)
    shard = functools.partial(fully_shard, mlp, mesh=_mesh())
    if name == "mesh_is_process_group":
        return mlp, lambda: fully_shard(mlp, mesh=dist.group.WORLD), TypeError, \
            r"mesh must be a .*DeviceMesh, got ProcessGroup; build one with init_device_mesh"
    if name == "mesh_is_string":
        return mlp, lambda: fully_shard(mlp, mesh="cpu"), TypeError, r"mesh must be a .*DeviceMesh, got str"
    if name == "mesh_3d":
        mesh = init_device_mesh("cpu", (1, 1, dist.get_world_size()), mesh_dim_names=("a", "b", "c"))
        return mlp, lambda: fully_shard(mlp, mesh=mesh), ValueError, r"mesh has 3 dims; use a 1-D mesh"
    if name == "mesh_2d_unnamed":
        mesh = init_device_mesh("cpu", (1, dist.get_world_size()))
        return mlp, lambda: fully_shard(mlp, mesh=mesh), ValueError, \
            r"a 2-D mesh means HSDP \(replicate, shard\) and needs axis names; build it with init_device_mesh"
    if name.startswith("reshard_after_forward="):
        value = name.split("=", 1)[1]
        if value.lstrip("-").isdigit():
            return mlp, lambda: shard(reshard_after_forward=int(value)), ValueError, \
                rf"reshard_after_forward={value} must divide the mesh size 2; use one of \[1, 2\] or a bool"
        return mlp, lambda: shard(reshard_after_forward=value), TypeError, \
            r"reshard_after_forward must be None, a bool or an int, got 'yes'"
    if name == "child_after_parent":  # torch: TypeError from deep inside (unnamed mesh) or accepted (named)
        fully_shard(mlp, mesh=_mesh())
        return mlp, lambda: fully_shard(mlp.in_proj, mesh=_mesh()), ValueError, \
            r"fully_shard: parameter 'weight' \(of a Linear\) is already sharded by an earlier fully_shard on a " \
            r"module that contains it. fully_shard goes bottom-up: call fully_shard on the children " \
            r"\(e.g. each block\) first, then on the parent"
    if name == "mesh_on_meta":
        meta_mesh = init_device_mesh("meta", (dist.get_world_size(),))
        return mlp, lambda: fully_shard(mlp, mesh=meta_mesh), ValueError, \
            r"fully_shard: the mesh is on the meta device.* build the mesh on the device that runs the model " \
            r"\(init_device_mesh\('cuda', ...\) or 'cpu'\) and the model on meta instead"
    if name == "params_on_meta_and_cpu":
        with torch.device("meta"):
            mlp.out_proj = nn.Linear(32, 8)
        return mlp, shard, ValueError, \
            r"parameters are on different devices \(.*out_proj.weight on meta.*\); move the module to one device"
    if name == "fully_shard_twice":
        shard()
        return mlp, shard, ValueError, r"fully_shard was already applied to this FSDPMLP; apply it once per module"
    if name == "placement_not_shard":
        return mlp, lambda: shard(shard_placement_fn=lambda p: Replicate()), TypeError, \
            r"shard_placement_fn returned Replicate\(\) for 'in_proj.weight'; " \
            r"return Shard\(dim\), None or a ShardPlacementResult"
    if name == "placement_dim_too_large":
        return mlp, lambda: shard(shard_placement_fn=lambda p: Shard(p.ndim)), ValueError, \
            r"chose Shard\(2\) for 'in_proj.weight' of shape \(32, 8\); pick a dim in \[0, 2\)"
    if name == "placement_dim_too_negative":
        return mlp, lambda: shard(shard_placement_fn=lambda p: Shard(-3)), ValueError, \
            r"chose Shard\(-3\) for 'in_proj.weight' .*; pick a dim in \[0, 2\)"
    if name == "scalar_param":
        module = WithScalar()
        return module, lambda: fully_shard(module, mesh=_mesh()), ValueError, \
            r"parameter 'temperature' is a scalar \(0-dim\) .*reshape it to \(1,\) or pass it in ignored_params"
    raise KeyError(name)


# In the other cases only the arguments were bad: the module must still shard and run after.
_INVALID_MODULE = {"params_on_meta_and_cpu", "fully_shard_twice", "scalar_param", "child_after_parent"}


def _check_case(name: str) -> None:
    module, call, exc, match = _case(name)
    _expect_rejected(module, call, exc, match,
                     already_sharded=name in ("fully_shard_twice", "child_after_parent"))
    if name not in _INVALID_MODULE:
        x = torch.randn(2, 8)
        expected = module(x)
        fully_shard(module, mesh=_mesh())
        torch.testing.assert_close(module(x), expected)


CASES = [
    "mesh_is_process_group", "mesh_is_string", "mesh_3d", "mesh_2d_unnamed", "mesh_on_meta",
    "reshard_after_forward=3", "reshard_after_forward=0", "reshard_after_forward=-1",
    "reshard_after_forward=yes",
    "params_on_meta_and_cpu", "fully_shard_twice",
    "placement_not_shard", "placement_dim_too_large", "placement_dim_too_negative", "scalar_param",
    "child_after_parent",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_argument_raises_and_leaves_module_unchanged(case):
    run_on_ranks(_check_case, 2, case)


# ---- cases with no process group needed --------------------------------------------------
@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
def test_mixed_precision_policy_rejects_integer_dtype(field):
    with pytest.raises(ValueError, match=rf"MixedPrecisionPolicy.{field} must be a floating-point dtype, "
                                         r"got torch.int32; use torch.float32"):
        MixedPrecisionPolicy(**{field: torch.int32})
    with pytest.raises(TypeError, match=rf"MixedPrecisionPolicy.{field} must be a torch.dtype or None, "
                                        rf"got 'bf16'; pass e.g. {field}=torch.bfloat16"):
        MixedPrecisionPolicy(**{field: "bf16"})


@pytest.mark.parametrize("bad", ["model", 3, [], None])
def test_non_module_argument_raises_type_error(bad):
    with pytest.raises(TypeError, match=r"fully_shard expects an nn.Module or a non-empty list of nn.Modules"):
        fully_shard(bad)


def test_list_with_a_non_module_leaves_the_modules_unchanged():
    mlp = MLP(8)
    _expect_rejected(mlp, lambda: fully_shard([mlp, "not a module"]), TypeError,
                     r"expects an nn.Module or a non-empty list of nn.Modules, got list")


def test_register_fsdp_forward_method_on_unsharded_module_raises():
    mlp = MLP(8)
    _expect_rejected(mlp, lambda: register_fsdp_forward_method(mlp, "forward"), ValueError,
                     r"register_fsdp_forward_method: MLP is not fully_shard-ed; call fully_shard\(module\) first")


# ---- code written for torch's FSDP2 catches what it caught -----------------------------------
def _torch_exception(name: str) -> type[BaseException] | None:
    """The exception torch's ``fully_shard`` raises for ``name`` (None: it accepts the call)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    global fully_shard
    ours, fully_shard = fully_shard, torch_fully_shard  # _case calls the module-level name
    try:
        _module, call, _exc, _match = _case(name)
        call()
    except Exception as e:  # noqa: BLE001 - which type torch raises is the point
        return type(e)
    finally:
        fully_shard = ours
    return None


def _exception_types(name: str) -> tuple[type | None, type]:
    theirs = _torch_exception(name)
    _module, call, exc, _match = _case(name)
    with pytest.raises(exc) as raised:
        call()
    return theirs, raised.type


# Where torch 2.13 does not raise a deliberate error (docs/comparison.md lists these): it
# accepts the call, or fails with an AttributeError deep inside.
_TORCH_ACCEPTS = {"params_on_meta_and_cpu"}
_TORCH_ATTRIBUTE_ERROR = {"mesh_is_process_group", "mesh_is_string", "mesh_on_meta"}


@pytest.mark.parametrize("case", CASES)
def test_what_torch_raises_is_caught_by_the_same_except_clause(case):
    theirs, ours = run_on_ranks(_exception_types, 2, case)[0]
    if case in _TORCH_ACCEPTS:
        assert theirs is None
    elif case in _TORCH_ATTRIBUTE_ERROR or (case == "placement_not_shard" and not CHECKS_SHARD_PLACEMENT_TYPE):
        assert theirs is AttributeError
    else:
        assert issubclass(ours, theirs), f"torch raises {theirs.__name__}, fsdp2 {ours.__name__}"


# ---- a parameter in two groups: refused at the first forward, as torch does ---------------
class TiedLM(nn.Module):
    """Tied embedding and output weights: one parameter used by two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, 16)
        self.head = nn.Linear(16, 17, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def _shared_between_groups(impl: Callable, attempts: int) -> list[str]:
    """Shard the two users separately (``between``: each in a group of its own, then the root;
    ``with_root``: the head alone, the embedding left to the root); both calls are accepted and
    the first forward raises, and each of the next ``attempts - 1`` the same (torch's second
    forward gets past its check and fails elsewhere)."""
    outcomes = []
    for layout in ("between", "with_root"):
        model = TiedLM()
        if layout == "between":
            impl(model.embed, mesh=_mesh())
        impl(model.head, mesh=_mesh())
        impl(model, mesh=_mesh())  # accepted
        ids = torch.randint(0, 17, (2, 8))
        messages = []
        for _attempt in range(attempts):
            with pytest.raises(ValueError) as raised:
                model(ids)
            messages.append(str(raised.value))
        assert all(m == messages[0] for m in messages)
        outcomes.append(messages[0])
    return outcomes


def _shared_both_impls():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    theirs = _shared_between_groups(torch_fully_shard, 1) if REFUSES_PARAMS_IN_TWO_GROUPS else None
    return _shared_between_groups(fully_shard, 3), theirs


def test_a_parameter_shared_by_two_groups_is_refused_at_the_first_forward_as_torch_does():
    ours, theirs = run_on_ranks(_shared_both_impls, 2)[0]
    if theirs is not None:  # torch raises ValueError there too (2.13; 2.11 accepts it: tests/_torch.py)
        assert all("already managed by another" in m for m in theirs)
    between, with_root = ours
    assert between == (
        "fully_shard: parameter 'head.weight' is shared with a parameter already managed by another fully_shard "
        "group (fully_shard(Embedding) as 'weight'): one parameter cannot be sharded in two groups. Apply "
        "fully_shard to a common parent of both modules that use it (e.g. keep tied embedding and output weights "
        "in the root group), or pass it in ignored_params")
    assert with_root.startswith("fully_shard: parameter 'embed.weight' is shared with a parameter already managed "
                                "by another fully_shard group (fully_shard(Linear) as 'weight')")


def test_a_container_without_forward_is_refused():
    mlps = nn.ModuleList([MLP(8), MLP(8)])
    _expect_rejected(mlps, lambda: fully_shard(mlps), ValueError,
                     r"a ModuleList has no forward, so its hooks would never run; pass its modules as a list")
