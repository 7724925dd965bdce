"""``state_dict`` / ``load_state_dict`` on ``fully_shard``-ed modules, with no communication.

Outside forward and backward the modules hold the sharded DTensor parameters,
so ``nn.Module.state_dict`` already returns them under the unsharded model's
keys. Three hooks per sharded module cover the rest:

- a state-dict post-hook that, while the group is unsharded (after an explicit
  ``unshard()``, or a forward whose parameters were kept for backward), puts the
  sharded DTensors back in place of the full tensors the modules hold then;
- a load pre-hook that reshards the group (its full tensors would be stale after
  the load) and cuts a full plain tensor down to this rank's box (its rows,
  of its TP chunk for tensor-parallel parameters), so
  ``load_state_dict`` accepts full tensors as well as DTensors. A full tensor
  of the wrong shape is left alone: ``nn.Module`` reports it as a size mismatch
  naming the key and both shapes. With ``assign=True`` it first checks every
  DTensor that would replace a parameter of any group under the module (mesh,
  placements, shape), so a bad one raises before anything is assigned;
- a load post-hook that takes the parameters ``assign=True`` put on the modules as
  the group's sharded ones, re-padded (``ParamGroup.adopt_registered``; torch's
  ``reset_sharded_param``).

Keys are found from the module tree at hook time (a parameter may be tied under
several names), never cached, so a module re-parented after ``fully_shard``
still loads under its current names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import _compat
from .._common import STATE_ATTR
from ._param import ShardedParam
from ._shapes import StateShape

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle


__all__ = ["register_state_dict_hooks", "shard_full_tensor"]


def register_state_dict_hooks(state: StateShape) -> list[RemovableHandle]:
    """Install the save and load hooks on each of ``state``'s modules; returns their handles."""
    handles = []
    for module in state.modules:
        handles.append(module.register_state_dict_post_hook(
            lambda m, sd, prefix, _meta: _sharded_on_save(state, m, sd, prefix)))
        handles.append(module.register_load_state_dict_pre_hook(
            lambda m, sd, prefix, meta, *_rest: _shard_on_load(state, m, sd, prefix, meta)))
        handles.append(module.register_load_state_dict_post_hook(lambda m, _keys: _adopt_assigned(state)))
    return handles


def shard_full_tensor(param: ShardedParam, full: torch.Tensor) -> DTensor:
    """This rank's box of ``full`` (the parameter's global shape) as a DTensor like ``param``'s.

    A view of ``full``: nothing is copied or communicated; ``copy_`` into the
    sharded parameter then moves only this rank's values. The box is cut by
    tensor parallelism first, then by FSDP (:meth:`ShardedParam.local_box`).
    """
    local = full
    for dim, (start, stop) in enumerate(param.local_box()):
        local = local.narrow(dim, start, stop - start)
    return param.as_sharded_dtensor(local)


def _param_keys(state: StateShape, module: nn.Module, prefix: str) -> Iterator[tuple[str, ShardedParam]]:
    """Every state-dict key, under ``module`` at ``prefix``, that names one of the group's parameters."""
    if not state.groups:
        return
    names = _relative_prefixes(module, state)
    for param in (p for group in state.groups for p in group.params):
        for owner, name in param.locations:
            for rel in names.get(id(owner), ()):
                yield f"{prefix}{rel}{name}", param


def _relative_prefixes(root: nn.Module, state: StateShape) -> dict[int, list[str]]:
    """``id(module) -> ["a.b.", ...]`` for modules under ``root`` outside other sharded subtrees."""
    found: dict[int, list[str]] = {}
    stack = [(root, "")]
    while stack:
        module, rel = stack.pop()
        found.setdefault(id(module), []).append(rel)
        for name, child in module._modules.items():
            # Another group's subtree holds none of our parameters (fully_shard rejects sharing).
            if child is not None and child.__dict__.get(STATE_ATTR, state) is state:
                stack.append((child, f"{rel}{name}."))
    return found


def _sharded_on_save(state: StateShape, module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
    if not state.groups:
        return
    # Even when the modules hold the shards and nn.Module saved them, its detach() may have
    # put the value on an equal, older mesh (``_compat.keep_spec``): always write it here.
    for key, param in _param_keys(state, module, prefix):
        if key in state_dict:
            # Same choice nn.Module makes: detach unless keep_vars (then the value is a Parameter).
            keep_vars = isinstance(state_dict[key], nn.Parameter)
            state_dict[key] = param.sharded if keep_vars else _compat.detach(param.sharded)


def _shard_on_load(state: StateShape, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                   local_metadata: dict[str, Any]) -> None:
    if local_metadata.get("assign_to_params_buffers"):
        _check_assigned(module, state_dict, prefix)
    # Loading overwrites the shards; full parameters gathered before would be stale.
    for group in state.groups:
        group.reshard()
    for key, param in _param_keys(state, module, prefix):
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                and value.shape == param.global_shape:
            state_dict[key] = shard_full_tensor(param, value)


def _check_assigned(module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
    """``load_state_dict(assign=True)``: every DTensor about to replace a parameter of a group
    under ``module`` is laid out as that parameter (full plain tensors are cut down instead)."""
    for name, sub in module.named_modules(remove_duplicate=False):
        state = sub.__dict__.get(STATE_ATTR)  # (as _state.get_state, which sits above this file)
        if state is None or not state.groups or sub not in state.modules:
            continue
        for key, param in _param_keys(state, sub, f"{prefix}{name}." if name else prefix):
            value = state_dict.get(key)
            if isinstance(value, DTensor) and value.shape == param.global_shape:  # (else nn.Module's size mismatch)
                param.check_replacement(value, f"load_state_dict(assign=True): key {key!r}")


def _adopt_assigned(state: StateShape) -> None:
    """After loading: parameters ``assign=True`` replaced become the group's sharded ones."""
    for group in state.groups:
        group.adopt_registered(True, "after load_state_dict(assign=True)")
