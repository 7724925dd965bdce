"""``patch_torch()``: make code written against torch's FSDP2 names run on fsdp2, unchanged.

The one module of the package that imports ``torch.distributed.fsdp``, only to put fsdp2's
objects in place of torch's and to put torch's back.

Two kinds of module hold torch's FSDP2 objects, and each is patched its own way:

* torch's own FSDP2 namespaces (``torch.distributed.fsdp``, its ``_fully_shard`` package
  and submodules, ``torch.distributed._composable.fsdp`` and its ``fully_shard``
  submodule): their attribute lookups answer with fsdp2's objects (the module object's
  class becomes a subclass of ``ModuleType`` that looks the FSDP2 names up in the patch
  first). Their ``__dict__`` is left alone, because torch's own functions read their
  globals from it: torch's implementation keeps working for whoever still holds its
  objects, and ``from torch.distributed.fsdp import fully_shard`` (an attribute lookup)
  gets fsdp2's.
* every other already-imported module outside torch (torchtitan, Accelerate, the user's
  own): a module-level name bound to exactly one of torch's original objects (``from
  torch.distributed.fsdp import fully_shard`` done before the patch) is rebound to fsdp2's.

Undoing puts back exactly what was changed (a name someone rebound meanwhile is left as
they set it). torch's pipelining (``torch.distributed.pipelining`` and its submodules) is
rebound as such a module: it drives FSDP2 stages through these names. Other torch modules
(checkpointing, ...) are not touched.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import Any

from ._api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from .runtime._fully_shard import fully_shard
from .runtime._module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx

__all__ = ["patch_torch"]

logger = logging.getLogger(__name__)

# The modules whose FSDP2 names are patched, imported so that they are there to patch.
_TORCH_NAMESPACES = ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard",
                     "torch.distributed._composable.fsdp", "torch.distributed._composable.fsdp.fully_shard")
# fsdp2's counterpart of each FSDP2 name torch exports: the objects ``fsdp2`` itself exports
# under those names (imported from where they are defined: ``fsdp2/__init__.py`` imports this file).
_OURS: dict[str, Any] = {obj.__name__: obj for obj in (
    CPUOffloadPolicy, DataParallelMeshDims, FSDPModule, fully_shard, MixedPrecisionPolicy, OffloadPolicy,
    register_fsdp_forward_method, UnshardHandle, share_comm_ctx)}
_NAMESPACE_PREFIXES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
# torch's own modules that use FSDP2 as a client does, rebound like one: pipelining checks
# ``isinstance(stage, FSDPModule)`` and drives the stage through ``fully_shard.state``.
_TORCH_CLIENTS = ("torch.distributed.pipelining",)


class _Patched(types.ModuleType):
    """The class of a torch FSDP2 namespace module while patched: its FSDP2 names answer fsdp2's."""

    def __getattribute__(self, name: str) -> Any:
        replaced = _NAMESPACE_NAMES.get(types.ModuleType.__getattribute__(self, "__name__"))
        if replaced is not None and name in replaced:
            return replaced[name]
        return types.ModuleType.__getattribute__(self, name)


# While patched: module name -> {FSDP2 name: fsdp2's object} for the swapped namespaces.
# Read by _Patched on every attribute lookup; empty when nothing is patched.
_NAMESPACE_NAMES: dict[str, dict[str, Any]] = {}


class _State:
    """What one application of the patch changed, to put back when the last handle is undone."""

    def __init__(self) -> None:
        self.handles = 0
        self.swapped: list[types.ModuleType] = []  # namespaces whose class became _Patched
        self.rebound: list[tuple[dict, str, Any, Any]] = []  # (module dict, name, original, fsdp2's)
        self.modules_before: set[str] = set()
        self.replacements: dict[int, tuple[Any, Any]] = {}  # id(torch's) -> (torch's, fsdp2's)


_STATE: list[_State] = []  # at most one: the patch in force


class PatchHandle:
    """Returned by :func:`patch_torch`; ``undo()`` (or leaving the ``with`` block) ends this patch.

    Undoing one handle twice does nothing the second time; the patch stays in force until
    every handle that :func:`patch_torch` returned has been undone.
    """

    def __init__(self) -> None:
        self._active = True

    @property
    def active(self) -> bool:
        """Whether this handle still holds the patch (it has not been undone)."""
        return self._active

    def undo(self) -> None:
        if not self._active:
            return
        self._active = False
        state = _STATE[0]
        state.handles -= 1
        if state.handles == 0:
            _restore(state)
            _STATE.clear()

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def patch_torch() -> PatchHandle:
    """Make torch's FSDP2 names fsdp2's, until the returned handle is undone.

    Replaces ``fully_shard``, ``FSDPModule``, ``UnshardHandle``, ``MixedPrecisionPolicy``,
    ``OffloadPolicy``, ``CPUOffloadPolicy``, ``register_fsdp_forward_method``,
    ``DataParallelMeshDims`` and ``share_comm_ctx`` (those of them this torch exports) as seen
    through ``torch.distributed.fsdp``, ``torch.distributed.fsdp._fully_shard`` and its
    submodules, and ``torch.distributed._composable.fsdp`` (and its ``fully_shard`` module),
    and rebinds those names in already-imported modules outside torch that hold torch's
    originals; see the module docstring for how. So torchtitan, Accelerate and the HF Trainer
    call fsdp2's ``fully_shard`` and their ``isinstance(m, FSDPModule)`` checks see fsdp2's
    modules. Idempotent: a call while patched returns another handle on the same patch.

    Usage: ``with fsdp2.patch_torch(): ...``, or ``handle = fsdp2.patch_torch()`` and later
    ``handle.undo()``.

    Note: code that imports torch's names while patched gets fsdp2's objects and keeps them
    after the undo (import again to get torch's); torch's own modules imported while patched
    are put back on undo.
    """
    if _STATE:
        _STATE[0].handles += 1
        return PatchHandle()
    state = _apply()
    state.handles = 1
    _STATE.append(state)
    return PatchHandle()


def _replacements() -> dict[int, tuple[Any, Any]]:
    public = importlib.import_module("torch.distributed.fsdp._fully_shard")  # to replace its names
    out = {}
    for name in public.__all__:
        ours = _OURS.get(name)
        if ours is None:  # a name a newer torch adds: left as torch's, and said so
            logger.warning("fsdp2.patch_torch: torch.distributed.fsdp.%s has no fsdp2 counterpart; left as torch's",
                           name)
            continue
        original = getattr(public, name)
        out[id(original)] = (original, ours)
    return out


def _apply() -> _State:
    for name in _TORCH_NAMESPACES:
        importlib.import_module(name)  # to patch them; see the module docstring
    state = _State()
    state.replacements = _replacements()
    state.modules_before = set(sys.modules)
    try:
        for module_name, module in list(sys.modules.items()):
            held = _held_originals(module, state.replacements)
            if not held:
                continue
            if module_name.startswith(_NAMESPACE_PREFIXES) and type(module) is types.ModuleType:
                _NAMESPACE_NAMES[module_name] = {name: ours for name, (_orig, ours) in held.items()}
                module.__class__ = _Patched
                state.swapped.append(module)
            elif not _is_torch(module_name) or module_name.startswith(_TORCH_CLIENTS):
                namespace = vars(module)
                for name, (original, ours) in held.items():
                    namespace[name] = ours
                    state.rebound.append((namespace, name, original, ours))
    except BaseException:
        _restore(state)
        raise
    logger.info("fsdp2.patch_torch: %d torch namespaces patched, %d names rebound in other modules",
                len(state.swapped), len(state.rebound))
    return state


def _held_originals(module: Any, replacements: dict[int, tuple[Any, Any]]) -> dict[str, tuple[Any, Any]]:
    """The module-level names of ``module`` bound to one of torch's originals."""
    namespace = getattr(module, "__dict__", None) if isinstance(module, types.ModuleType) else None
    if not isinstance(namespace, dict):
        return {}
    return {name: replacements[id(value)] for name, value in list(namespace.items())
            if id(value) in replacements and replacements[id(value)][0] is value}


def _is_torch(module_name: str) -> bool:
    return module_name == "torch" or module_name.startswith("torch.")


def _restore(state: _State) -> None:
    for module in state.swapped:
        module.__class__ = types.ModuleType
        _NAMESPACE_NAMES.pop(module.__name__, None)
    for namespace, name, original, ours in state.rebound:
        if namespace.get(name) is ours:  # rebound since by someone else: theirs stays
            namespace[name] = original
    # torch's own modules imported while patched took fsdp2's objects from the namespaces;
    # torch never imports fsdp2, so every such binding came from the patch.
    back = {id(ours): (ours, original) for original, ours in state.replacements.values()}
    for module_name in set(sys.modules) - state.modules_before:
        module = sys.modules.get(module_name)
        if not _is_torch(module_name) or not isinstance(module, types.ModuleType):
            continue
        namespace = vars(module)
        for name, value in list(namespace.items()):
            if id(value) in back and back[id(value)][0] is value:
                namespace[name] = back[id(value)][1]
    state.swapped, state.rebound = [], []
