"""The runtime's base: the shapes of its state, as the files below the state read it.

``ModuleState`` and ``RootContext`` (``_state.py``) and ``ParamGroup`` (``_group.py``) sit at
the top of the runtime, ``ShardedParam`` (``_param.py``) above its all-gather extension. The
files they build on (the checks, the reduction, the state-dict and autograd hooks, the
pipelining view, the extension) are handed those objects and name them only through the
protocols here. This file imports nothing of the runtime, so the runtime's imports all point
one way: down to here (and to ``fsdp2/_common.py``, the state attribute and the enums every
layer shares).

The protocols list only what those files read and call; the classes above satisfy them
structurally (nothing inherits from them). An attribute whose class lives above this file
is typed ``Any``, its class named beside it.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from .._format import Chunking

__all__ = ["GroupShape", "ParamShape", "RootShape", "StateShape"]


class ParamShape(Protocol):
    """A sharded parameter (``ShardedParam``, ``_param.py``) as its all-gather extension reads it."""

    fqn: str
    locations: list[tuple[torch.nn.Module, str]]  # (module, attribute name) per place it is registered
    layout: Chunking  # how the parameter is cut into one padded chunk per rank
    sharded: torch.nn.Parameter  # the sharded DTensor parameter
    unsharded: torch.nn.Parameter | None
    padded_local: torch.Tensor  # this rank's padded shard
    ext: Any  # _extension.ParamExtension | None

    @property
    def param_dtype(self) -> torch.dtype: ...
    def bind_unsharded(self, region: torch.Tensor, on_grad_ready: Callable[[Any], None]) -> None: ...
    def bind_unsharded_tensor(self, tensor: torch.Tensor, on_grad_ready: Callable[[Any], None]) -> None: ...


class RootShape(Protocol):
    """A root's per-iteration context (``RootContext``)."""

    states: list[StateShape]  # every module state under the root, in registration order
    iteration: int  # root forwards started, from 0
    shape_inference: bool  # this forward is torch 2.11 pipelining's no_grad one
    diag: Any  # _checks.Diagnostics | None: built at lazy init


class GroupShape(Protocol):
    """A parameter group (``ParamGroup``)."""

    label: str
    params: list[Any]  # ShardedParam, in the group's order
    dp: Any  # _mesh.DataParallelMesh
    process_group: Any  # the shard axis's dist.ProcessGroup
    world: int  # the shard axis's size
    device: torch.device
    policy: Any  # _policy.GroupPolicy
    root: RootShape | None  # set at lazy init
    header_slot: Any  # _checks.HeaderSlot | None
    reduce_transport: Any  # comm._transport.Transport
    reduce_queue: Any  # _reduce_queue.ReduceQueue: the root's, shared
    partial_sums: dict[torch.dtype, torch.Tensor]
    shards_are_full: bool
    post_backward_done: bool

    def reshard(self) -> None: ...
    def post_backward(self) -> None: ...
    def adopt_registered(self, move: bool, where: str) -> None: ...


class StateShape(Protocol):
    """A sharded module's state (``ModuleState``)."""

    modules: tuple[torch.nn.Module, ...]  # the modules passed to fully_shard together
    groups: list[GroupShape]  # one per mesh
    is_root: bool | None  # decided at lazy init
    ctx: RootShape | None  # the root's context, set at lazy init
    pipeline_checked: bool
    _handles: list[Any]  # hook handles removed with the state

    def _pre_backward_hook(self, grad: torch.Tensor) -> None: ...  # the pre-backward, run eagerly
    def _end_of_backward(self) -> None: ...
