"""fsdp2 under ``torch.distributed.pipelining``: what a pipeline stage reaches of its FSDP module.

Pipelining drives a stage's FSDP2 module itself when it recognises one
(``isinstance(submod, FSDPModule)`` against the name its modules imported from
``torch.distributed.fsdp``, which ``fsdp2.patch_torch()`` makes fsdp2's): every microbatch's
backward runs with gradient sync, resharding after backward and the last-backward wait off,
so gradients accumulate unsharded and the parameters stay gathered; once per step, after the
stage's last backward, it turns them back on, finishes each group's backward and then the
root's through ``fully_shard.state(module)``. :func:`state` answers that call with a view of
fsdp2's state that has the few members pipelining uses, named as torch's
(``_state_ctx.all_states``, each state's ``_fsdp_param_groups`` (torch 2.13's pipelining, read) or
``_fsdp_param_group`` (earlier pipelining, seen in its published source), a group's
``post_backward()``, the root's ``_root_post_backward_final_callback()``).

Imported directly (``from fsdp2 import fully_shard``), fsdp2's modules are not torch's
``FSDPModule``, so pipelining treats the stage as a plain module: each microbatch's backward
reduce-scatters and reshards, and the next forward gathers again. That is correct but costs a
collective pair per microbatch where torch issues one per step, so :func:`check_stage` warns
once, naming ``patch_torch()``. The zero-bubble schedules (and DualPipeV) split backward into an
input pass and a weight pass that pipelining runs itself (``torch.autograd.grad`` to the inputs,
then to the weights' gradient edges, whose gradients it sets on the parameters after the call):
there fsdp2 drives the stage as pipelining drives torch's FSDP2 (:class:`_SplitBackward`),
with the same collectives as the patched route and no warning.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

from .. import _compat
from ._tree import iter_tensors
from .._common import STATE_ATTR
from .._errors import FSDPValueError
from ._shapes import GroupShape, StateShape

if TYPE_CHECKING:
    from ._param import ShardedParam

__all__ = ["state", "check_stage"]

logger = logging.getLogger(__name__)


class _GroupView:
    """One group as pipelining sees torch's parameter group: ``post_backward()`` finishes its backward."""

    def __init__(self, group: GroupShape) -> None:
        self._group = group

    def post_backward(self) -> None:
        """Reduce-scatter the gradients accumulated over the step's microbatches (when syncing) and
        reshard (when resharding after backward), as the group's own post-backward would."""
        group = self._group
        if group.post_backward_done:  # as torch's, safe to call twice in one backward
            return
        group.post_backward()


class _StateView:
    """What ``fully_shard.state(module)`` gives pipelining: the members it uses, named as torch's."""

    def __init__(self, module_state: StateShape) -> None:
        self._state = module_state
        groups = [_GroupView(group) for group in module_state.groups]  # one per mesh, in torch's order
        self._fsdp_param_groups = groups  # torch 2.13 on: a list per module
        self._fsdp_param_group = groups[0] if groups else None  # torch 2.11: one or None

    @property
    def _state_ctx(self) -> _StateContextView:
        return _StateContextView(self._state)

    def _root_post_backward_final_callback(self) -> None:
        """End the backward as the root's end-of-backward callback does: finish the groups not
        finished yet, wait for the reductions when this is the last backward, reset per-backward state."""
        if self._state.ctx is not None:  # (no forward yet: nothing to end)
            _root_of(self._state)._end_of_backward()


class _StateContextView:
    """``_state_ctx``: the states of every module under the root (``all_states``)."""

    def __init__(self, module_state: StateShape) -> None:
        ctx = module_state.ctx
        self.all_states = [_StateView(s) for s in (ctx.states if ctx is not None else [module_state])]


def _root_of(module_state: StateShape) -> StateShape:
    return next(s for s in module_state.ctx.states if s.is_root)


def state(module: Any) -> _StateView:
    """``fully_shard.state(module)``: fsdp2's state of ``module`` as pipelining reads torch's.

    Raises:
        ValueError: ``module`` was not passed to ``fully_shard``.
    """
    found = module.__dict__.get(STATE_ATTR) if hasattr(module, "__dict__") else None  # (_state.get_state's lookup)
    if found is None:
        raise FSDPValueError(f"fully_shard.state: {type(module).__name__} was not passed to fully_shard; "
                             "call fully_shard(module) first")
    return _StateView(found)


# ---- the direct route ---------------------------------------------------------------------
def check_stage(module_state: StateShape) -> None:
    """At a root forward: if pipelining runs this module as a stage without recognising it as
    an FSDP module, warn once (every microbatch reduces), or drive it under a split-backward
    schedule (:class:`_SplitBackward`). Marks torch 2.11's shape-inference forward.

    Looks at the caller's frames only while ``torch.distributed.pipelining`` is imported, and
    only until the root has been seen under it once (``ModuleState.pipeline_checked``).
    """
    stage_module = sys.modules.get("torch.distributed.pipelining.stage")
    if stage_module is None:
        return
    root = module_state.modules[0]
    if not torch.is_grad_enabled() and _compat.in_pipeline_shape_inference(root):
        # torch 2.11 runs the stage once under no_grad to learn its shapes; torch's FSDP2 then
        # keeps the groups its policy keeps, and the first step's forward gathers nothing again.
        module_state.ctx.shape_inference = True
    if isinstance(root, getattr(stage_module, "FSDPModule", ())):
        module_state.pipeline_checked = True
        return  # pipelining drives fsdp2 itself (patch_torch)
    stage, schedule = _compat.pipeline_stage_and_schedule(root)
    if stage is None:
        return  # not a stage (yet): looked at again at the next root forward
    module_state.pipeline_checked = True
    name = type(root).__name__
    if schedule is not None and _compat.schedule_splits_backward(schedule):
        if _compat.pipeline_last_backward(schedule, stage) is None:
            raise FSDPValueError(
                f"fsdp2: {name} is a stage of {type(schedule).__name__}, which splits backward into an input "
                "pass and a weight pass but does not count its stages' backward passes as torch's own "
                "schedules do (backward_counter), so fsdp2 cannot tell the step's last weight pass; call "
                "fsdp2.patch_torch() before sharding the stages (pipelining then drives fsdp2 as it drives "
                "torch's FSDP2)")
        _SplitBackward(module_state).start(stage, schedule)
        return  # the same collectives as the patched route: nothing to warn about
    logger.warning(
        "fsdp2: %s is a pipeline stage that torch.distributed.pipelining does not recognise as an FSDP "
        "module (sharded by `from fsdp2 import fully_shard`): every microbatch's backward reduce-scatters "
        "its gradients and the next forward all-gathers the parameters again, where torch's FSDP2 does "
        "both once per step. Training is correct; call fsdp2.patch_torch() before sharding the stages to "
        "let pipelining drive fsdp2 as it drives torch's FSDP2 (see docs/integrations.md)", name)


class _SplitBackward:
    """Drives a stage of a split-backward schedule that pipelining does not drive (direct import)
    as pipelining drives torch's FSDP2 through ``patch_torch()``.

    Every backward of the step runs with gradient sync, resharding after backward and the
    last-backward wait off (set at each forward under the schedule), so the parameters stay
    gathered between an input pass and its weight pass and the gradients accumulate unsharded.
    The step's last pass that computes weight gradients (``_compat.pipeline_last_backward``)
    ends the step: a full backward through autograd's accumulation, a weight pass through the
    gradients pipelining asks of ``torch.autograd.grad`` for the weights' gradient edges. The
    unsharded parameters' tensor hooks see those (autograd runs a captured leaf's tensor hooks),
    and in that pass take each gradient into the unsharded ``.grad`` themselves, handing
    pipelining zeros to add, because pipelining sets the gradients only after the call returns,
    when nothing of fsdp2 runs again before the optimizer step. Once every parameter the stage's
    forward reached has its gradient, the end of that autograd call does what pipelining's
    ``perform_reduce_grad`` does for torch's FSDP2: sync and reshard on, each group's
    post-backward (one reduce-scatter per group), then the root's end of backward.

    Where pipelining's last assignment lands after that (``.grad = zeros`` on an unsharded
    parameter whose gradient was taken), the next forward clears it.
    """

    def __init__(self, root_state: StateShape) -> None:
        self._root = root_state
        self._stage: Any = None  # weak references to pipelining's objects, refreshed at each forward
        self._schedule: Any = None
        self._reached: set[int] = set()  # ids of the ShardedParams the last forward's graph reaches
        self._taken: set[int] = set()  # those whose gradient the final pass took so far
        self._final_queued = False
        self._stale = False  # the final pass ran: pipelining left zeros on unsharded .grad
        self._hooked: dict[int, weakref.ref] = {}  # unsharded parameters hooked (by id: tensors compare by value)

    def start(self, stage: Any, schedule: Any) -> None:
        """The stage's first forward under the schedule: this forward and every later one."""
        module = self._root.modules[0]
        self._root._handles.append(module.register_forward_pre_hook(self._before_forward_hook))
        self._root._handles.append(module.register_forward_hook(self._after_forward_hook))
        self._before_forward(stage, schedule)

    def _before_forward_hook(self, _module: Any, _args: Any) -> None:
        stage, schedule = _compat.pipeline_stage_and_schedule(self._root.modules[0])
        self._before_forward(stage, schedule)

    def _before_forward(self, stage: Any, schedule: Any) -> None:
        if self._taken:  # the last weight pass left a parameter the forward reached without a gradient
            self._taken = set()
            raise RuntimeError(
                f"fsdp2: the last weight pass of pipeline stage {type(self._root.modules[0]).__name__} gave no "
                "gradient to a parameter its forward uses, so fsdp2 never reduced the step's gradients; call "
                "fsdp2.patch_torch() before sharding the stages (pipelining then reduces them itself)")
        if self._stale:
            self._stale = False
            for p in self._params():
                if p.unsharded is not None:
                    p.unsharded.grad = None
        active = stage is not None and schedule is not None and _compat.schedule_splits_backward(schedule)
        self._stage = weakref.ref(stage) if active else None
        self._schedule = weakref.ref(schedule) if active else None
        if active:  # as pipelining's backward_maybe_with_nosync does for torch's FSDP2
            module = self._root.modules[0]
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)

    def _after_forward_hook(self, _module: Any, _args: Any, output: Any) -> None:
        if self._stage is None or not torch.is_grad_enabled():
            return
        by_tensor = {id(p.unsharded): p for p in self._params() if p.unsharded is not None}
        self._reached = {id(by_tensor[id(t)]) for t in _leaves_reached(output) if id(t) in by_tensor}
        me = weakref.ref(self)
        for p in self._params():
            u = p.unsharded
            hooked = self._hooked.get(id(u))
            if u is not None and u.requires_grad and (hooked is None or hooked() is not u):
                # Weak references: torch's garbage collector does not look into tensor hooks.
                u.register_hook(functools.partial(_weight_grad_hook, me, weakref.ref(p)))
                self._hooked[id(u)] = weakref.ref(u)

    def _params(self) -> list[ShardedParam]:
        ctx = self._root.ctx
        states = ctx.states if ctx is not None else [self._root]
        return [p for s in states for g in s.groups for p in g.params]

    def on_grad(self, p: ShardedParam, grad: torch.Tensor) -> torch.Tensor | None:
        """A hook on ``p``'s unsharded parameter: ``grad`` is on its way to it (see the class)."""
        stage = self._stage() if self._stage is not None else None
        schedule = self._schedule() if self._schedule is not None else None
        if stage is None or schedule is None or not _compat.pipeline_last_backward(schedule, stage):
            return None  # autograd, or pipelining after the call, accumulates it
        u = p.unsharded
        with torch.no_grad():
            if u.grad is None:  # (a copy: the incoming gradient may be another node's too)
                u.grad = grad.detach().clone()
            else:
                u.grad += grad
        self._taken.add(id(p))
        if not self._final_queued and self._reached <= self._taken:
            self._final_queued = True
            _compat.queue_end_of_backward_callback(self._reduce_step)
        return _zeros_like(grad)

    def _reduce_step(self) -> None:
        """After the stage's last weight gradients: what ``perform_reduce_grad`` does for torch's FSDP2."""
        self._final_queued = False
        self._taken.clear()
        module = self._root.modules[0]
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
        view = _StateView(self._root)
        for state in view._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.post_backward()
        view._root_post_backward_final_callback()
        self._stale = True


def _weight_grad_hook(driver: weakref.ref, param: weakref.ref, grad: torch.Tensor) -> torch.Tensor | None:
    d, p = driver(), param()
    return None if d is None or p is None else d.on_grad(p, grad)


def _zeros_like(grad: torch.Tensor) -> torch.Tensor:
    """Zeros for pipelining to add: one element expanded, where the gradient is a plain tensor."""
    if type(grad) is torch.Tensor:
        return grad.new_zeros(()).expand(grad.shape)
    return torch.zeros_like(grad)


def _leaves_reached(output: Any) -> list[torch.Tensor]:
    """The leaf tensors (parameters) the autograd graph of ``output`` accumulates into."""
    seen, leaves = set(), []
    todo = [t.grad_fn for t in iter_tensors(output) if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        todo.extend(fn for fn, _ in node.next_functions)
    return leaves
