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
once, naming ``patch_torch()``. The zero-bubble schedules (and DualPipeV) split backward into an input
pass and a weight pass and set the weights' gradients themselves; without pipelining's
coordination the stage is resharded between the two and its gradients would never be
reduced, so they are refused with an error naming the fix.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from .. import _compat
from .._errors import FSDPValueError

if TYPE_CHECKING:
    from ._group import ParamGroup
    from ._state import ModuleState

__all__ = ["state", "check_stage"]

logger = logging.getLogger(__name__)


class _GroupView:
    """One group as pipelining sees torch's parameter group: ``post_backward()`` finishes its backward."""

    def __init__(self, group: ParamGroup) -> None:
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

    def __init__(self, module_state: ModuleState) -> None:
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

    def __init__(self, module_state: ModuleState) -> None:
        ctx = module_state.ctx
        self.all_states = [_StateView(s) for s in (ctx.states if ctx is not None else [module_state])]


def _root_of(module_state: ModuleState) -> ModuleState:
    return next(s for s in module_state.ctx.states if s.is_root)


def state(module: Any) -> _StateView:
    """``fully_shard.state(module)``: fsdp2's state of ``module`` as pipelining reads torch's.

    Raises:
        ValueError: ``module`` was not passed to ``fully_shard``.
    """
    from ._state import get_state

    found = get_state(module) if hasattr(module, "__dict__") else None
    if found is None:
        raise FSDPValueError(f"fully_shard.state: {type(module).__name__} was not passed to fully_shard; "
                             "call fully_shard(module) first")
    return _StateView(found)


# ---- the direct route ---------------------------------------------------------------------
def check_stage(module_state: ModuleState) -> None:
    """At a root forward: if pipelining runs this module as a stage without recognising it as
    an FSDP module, warn once (every microbatch reduces) or refuse a split-backward schedule.

    Looks at the caller's frames only while ``torch.distributed.pipelining`` is imported, and
    only until the root has been seen under it once (``ModuleState.pipeline_checked``).
    """
    stage_module = sys.modules.get("torch.distributed.pipelining.stage")
    if stage_module is None:
        return
    root = module_state.modules[0]
    if isinstance(root, getattr(stage_module, "FSDPModule", ())):
        module_state.pipeline_checked = True
        return  # pipelining drives fsdp2 itself (patch_torch)
    stage, schedule = _compat.pipeline_stage_and_schedule(root)
    if stage is None:
        return  # not a stage (yet): looked at again at the next root forward
    module_state.pipeline_checked = True
    name = type(root).__name__
    if schedule is not None and _compat.schedule_splits_backward(schedule):
        raise FSDPValueError(
            f"fsdp2: {name} is a stage of {type(schedule).__name__}, which splits backward into an input "
            "pass and a weight pass and sets the weights' gradients itself; torch.distributed.pipelining "
            "does not recognise modules sharded by `from fsdp2 import fully_shard` as FSDP modules, so "
            "nothing would reduce those gradients. Call fsdp2.patch_torch() before sharding the stages "
            "(pipelining then drives fsdp2 as it drives torch's FSDP2), or use a schedule without a "
            "split backward (GPipe, 1F1B, Interleaved1F1B, LoopedBFS)")
    logger.warning(
        "fsdp2: %s is a pipeline stage that torch.distributed.pipelining does not recognise as an FSDP "
        "module (sharded by `from fsdp2 import fully_shard`): every microbatch's backward reduce-scatters "
        "its gradients and the next forward all-gathers the parameters again, where torch's FSDP2 does "
        "both once per step. Training is correct; call fsdp2.patch_torch() before sharding the stages to "
        "let pipelining drive fsdp2 as it drives torch's FSDP2 (see docs/integrations.md)", name)
