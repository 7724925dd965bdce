"""Per-module hooks and the root's per-iteration state.

Lifecycle of one training step (see docs/design.md):

1. pre-forward: (root: lazy init once) unshard the group, issue explicit
   forward prefetches, cast inputs.
2. post-forward: reshard per ``reshard_after_forward`` and hook the outputs so
   the group is unsharded again when backward reaches them.
3. pre-backward (first gradient reaching the outputs): unshard, prefetch the
   group that ran before this one in forward, and (once per backward) queue
   the root's end-of-backward callback.
4. post-backward (every trainable parameter's gradient accumulated and, for a
   group with frozen parameters, the gradients of the module's inputs computed;
   for a group that reduces unused parameters, the inputs' gradients alone):
   reduce-scatter, reshard.
5. end of backward (root callback): finish groups whose hooks did not fire,
   wait for reduce-scatters, reset per-iteration state.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import torch
import torch.nn as nn

from . import _checks, _pipeline
from .. import _compat
from .._api import MixedPrecisionPolicy
from .._common import STATE_ATTR, ShardState, TrainingState
from ._group import ParamGroup, ReduceQueue
from ._release import EarlyRelease
from ._param import raise_if_on_meta
from ._state_dict import register_state_dict_hooks
from ._autograd import InputsGradReady, Pending, PreBackward
from ._tree import cast_floating, iter_tensors, map_tensors

__all__ = ["TrainingState", "ModuleState", "RootContext", "get_state"]

logger = logging.getLogger(__name__)


def get_state(module: nn.Module) -> ModuleState | None:
    """The fsdp2 state of ``module`` (None if ``fully_shard`` was not applied to it)."""
    return module.__dict__.get(STATE_ATTR)


class RootContext:
    """State shared by every module under one root, for one iteration at a time."""

    def __init__(self, states: list[ModuleState]) -> None:
        self.states = states
        self.forward_order: list[ParamGroup] = []  # first-call order this iteration
        self.last_forward_order: list[ParamGroup] = []  # the previous iteration's: forward prefetch
        self.callback_queued = False
        # The queued end-of-backward callback finishes only the groups this backward reached:
        # only pre-backward hooks of standalone calls fired (see ModuleState._standalone_part).
        self.local_backward = False
        self.reduce_queue = ReduceQueue()
        self.is_last_backward = True
        self.in_forward = False
        # Groups gathered ahead of their use and not yet used, and the cap on how many
        # (None: no cap beyond the schedule's own; see FSDPModule.set_prefetch_limit).
        self.prefetched: set[ParamGroup] = set()
        self.prefetch_limit: int | None = None
        # Groups whose modules hold other groups (usually the root alone): with early release,
        # backward reduces their gradients as they become final and frees parts of them
        # (EarlyRelease.backward_reached).
        self.early: list[EarlyRelease] = []
        self.state_of: dict[ParamGroup, ModuleState] = {}  # each group's module state (several groups: one state)
        self.iteration = -1  # root forwards started, from 0 (all-gather headers, error messages)
        self.interrupted = False  # an exception left this iteration half-done (see _recover_if_interrupted)
        self.shape_inference = False  # this forward is torch 2.11 pipelining's no_grad one (_pipeline.check_stage)
        self.diag: _checks.Diagnostics | None = None

    def prefetch(self, targets: list[ParamGroup]) -> None:
        """Issue the all-gathers of ``targets`` now, within the prefetch limit."""
        self.prefetched = {g for g in self.prefetched if g.state in (ShardState.GATHERING, ShardState.UNSHARDED)}
        for group in targets:
            if group.state in (ShardState.GATHERING, ShardState.UNSHARDED):
                continue  # already gathered (or on its way)
            if self.prefetch_limit is not None and len(self.prefetched) >= self.prefetch_limit:
                return  # the rest gathers when reached
            group.unshard(async_op=True, whole=False)  # (backward reads no segment released early)
            self.prefetched.add(group)


class ModuleState:
    def __init__(self, modules: tuple[nn.Module, ...], groups: list[ParamGroup],
                 mp_policy: MixedPrecisionPolicy) -> None:
        self.modules = modules
        # One group per data-parallel mesh (shard_placement_fn's ShardPlacementResult, see
        # _placement.py), in torch's order; usually one. Forward runs them in this order,
        # backward and the end of backward in reverse, as torch's FSDP2 does.
        self.groups = list(groups)
        self.mp_policy = mp_policy
        self.is_root: bool | None = None  # decided at lazy init
        # reshard_after_forward=None: decided at lazy init (root keeps its parameters).
        self.auto_reshard_after_forward = bool(groups) and groups[0].policy.reshard_after_forward is None
        self.ctx: RootContext | None = None
        for group in self.groups:
            group.several_modules = len(modules) > 1
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[ModuleState] = []
        self.backward_prefetch: list[ModuleState] | None = None  # None or []: implicit
        # Implicit prefetch: forward gathers the group that ran next last iteration,
        # backward the group that ran before this one (see set_implicit_prefetch).
        self.implicit_prefetch = True
        self.prefetch_limit: int | None = None  # the root's becomes its RootContext's
        self._modules_to_run: set[nn.Module] = set()
        # Parameters an earlier fully_shard had sharded already, (fqn, that call): the root's
        # lazy init refuses them, as torch's FSDP2 does (set by fully_shard).
        self.shared_with_other_groups: list[tuple[str, str]] = []
        self._handles: list[Any] = []
        self.pipeline_checked = False  # seen by _pipeline.check_stage (the root's)
        # Every entry point from user code or the autograd engine runs eagerly under
        # torch.compile (see _compat.run_eagerly): a compiled forward graph-breaks here.
        self._pre_backward_hook = _compat.run_eagerly(self._pre_backward)
        self._standalone_pre_backward_hook = _compat.run_eagerly(
            lambda grad: self._pre_backward(grad, standalone=True))
        self._end_of_backward_callback = _compat.run_eagerly(self._end_of_backward)
        self._inputs_grad_ready = _compat.run_eagerly(self._each_inputs_grad_ready) if groups else None
        pre_hook = _compat.run_eagerly(self._pre_forward_hook)
        for module in modules:
            module.__dict__[STATE_ATTR] = self
            self._handles.append(module.register_forward_pre_hook(pre_hook, prepend=True, with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                _compat.run_eagerly(self._make_post_forward_hook(module)), prepend=False, always_call=True))
        self._handles.extend(register_state_dict_hooks(self))

    @property
    def group(self) -> ParamGroup | None:
        """The module's one parameter group (None if it has no parameters); ``groups`` where
        its parameters are on several meshes."""
        if len(self.groups) > 1:
            raise RuntimeError(f"fsdp2: {self.label()} has {len(self.groups)} parameter groups (one per mesh); "
                               "iterate over state.groups")
        return self.groups[0] if self.groups else None

    def _each_inputs_grad_ready(self, token: Any) -> None:
        for group in reversed(self.groups):  # backward's order
            if len(self.groups) == 1 or token in group.inputs_pending:  # (those whose reduction waited for it)
                group.inputs_grad_ready(token)

    def remove(self) -> None:
        """Undo the hooks and attributes (used when fully_shard fails half-way)."""
        for handle in self._handles:
            handle.remove()
        for module in self.modules:
            module.__dict__.pop(STATE_ATTR, None)

    # ---- lazy init ----------------------------------------------------------------------
    def lazy_init(self) -> None:
        if self.is_root is not None:
            return
        root_module = self.modules[0]
        names = {module: name for name, module in root_module.named_modules(remove_duplicate=False)}
        states: list[ModuleState] = []
        for module in root_module.modules():
            state = get_state(module)
            if state is not None and state not in states:
                states.append(state)
        for state in states:
            for fqn, owner in state.shared_with_other_groups:
                prefix = names.get(state.modules[0]) or ""
                name = f"{prefix}.{fqn}" if prefix else fqn
                raise ValueError(
                    f"fully_shard: parameter {name!r} is shared with a parameter "
                    f"already managed by another fully_shard group ({owner}): one parameter cannot be sharded "
                    "in two groups. Apply fully_shard to a common parent of both modules that use it (e.g. "
                    "keep tied embedding and output weights in the root group), or pass it in ignored_params"
                )
        for state in states:
            # A sub-module initialised on its own (e.g. its unshard() was called first) is
            # adopted as long as it is not in the middle of an iteration.
            busy = state.ctx is not None and (state.ctx.in_forward or state.ctx.callback_queued)
            if state is not self and state.is_root and busy:
                raise RuntimeError(
                    f"fully_shard: forward of {type(root_module).__name__} started while its sharded "
                    f"sub-module {state.label()} is mid-iteration as a root; run forward through the "
                    "outermost module"
                )
        ctx = RootContext(states)
        ctx.prefetch_limit = self.prefetch_limit
        owned = {module: state for state in states for module in state.modules}
        for state in states:
            state.is_root = state is self
            state.ctx = ctx
            label = ",".join(names.get(m, "?") or "root" for m in state.modules)
            for group in state.groups:
                ctx.state_of[group] = state
                # Several groups: each named by its mesh too (the ranks' checks and traces tell them apart).
                group.label = label if len(state.groups) == 1 else f"{label}[{_mesh_name(group)}]"
                group.reduce_queue = ctx.reduce_queue
                group.root = ctx
                if state.auto_reshard_after_forward:
                    group.policy.reshard_after_forward = not state.is_root
                if any(owned.get(m, state) is not state for module in state.modules for m in module.modules()):
                    if group.early is None:  # it holds other groups: backward's first group and its last
                        group.early = EarlyRelease(group)
                    ctx.early.append(group.early)
        ctx.diag = _checks.Diagnostics(states, names)
        groups = [group for state in states for group in state.groups]
        try:
            for group in groups:
                group.take_assigned()
            _checks.check_rank_agreement(ctx.diag)  # (before the next check: a rank alone on meta fails here)
            raise_if_on_meta([p for group in groups for p in group.params], lambda p: ctx.diag.param_names[id(p)])
        except Exception:
            for state in states:  # not initialised: the next forward checks again
                state.is_root, state.ctx = None, None
            raise
        for group in groups:
            group.prepared = True
        logger.debug("fsdp2: lazy init with root %s and %d groups", type(root_module).__name__, len(states))

    def label(self) -> str:
        return self.groups[0].label.split("[")[0] if self.groups else type(self.modules[0]).__name__

    # ---- forward ------------------------------------------------------------------------
    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._recover_if_interrupted()  # first: a reset clears _modules_to_run
        if not self._modules_to_run:
            self._modules_to_run.update(self.modules)
        return self.pre_forward(args, kwargs)

    def run_forward_method(self, module: nn.Module, method: Callable, args: tuple, kwargs: dict) -> Any:
        """Call ``module.<method>`` (``register_fsdp_forward_method``) between this group's
        pre- and post-forward, as ``forward`` is."""
        self._recover_if_interrupted()  # first: a reset clears _modules_to_run
        if not self._modules_to_run:
            self._modules_to_run.add(module)
        try:
            args, kwargs = self.pre_forward(args, kwargs)
            output = method(*args, **kwargs)
        except Exception:
            # As forward hooks with always_call do: free the parameters, mark the iteration.
            self._forward_method_done(module, None)
            raise
        return self._forward_method_done(module, output)

    def _forward_method_done(self, module: nn.Module, output: Any) -> Any:
        if module in self._modules_to_run:
            self._modules_to_run.discard(module)
            if not self._modules_to_run:
                return self.post_forward(output)
        return output

    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        recompute = _compat.in_backward()  # a forward re-run by backward (activation checkpointing)
        with _compat.outside_functorch():  # torch.func.jvp: gather plain tensors, not the transform's
            self._unshard_for_forward(recompute)
        if self.groups and not recompute and torch.is_grad_enabled():
            for group in self.groups:
                if not group.waits_for_inputs:  # should a parameter be frozen before backward, only the end
                    group.unhooked_forward = True  # of backward is safe
            if any(group.waits_for_inputs for group in self.groups):
                args, kwargs = self._hook_inputs_grad_ready(args, kwargs)
        policy = self.mp_policy
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), policy.param_dtype)
        return args, kwargs

    def _unshard_for_forward(self, recompute: bool) -> None:
        """Lazy init, then gather this group (and prefetch the next) for forward."""
        self.lazy_init()
        ctx = self.ctx
        if self.is_root and not ctx.in_forward and not recompute:
            if not self.pipeline_checked:  # a pipeline stage pipelining does not drive (direct import)?
                _pipeline.check_stage(self)
            ctx.in_forward = True
            ctx.iteration += 1
            if ctx.forward_order:
                ctx.last_forward_order = list(ctx.forward_order)
            ctx.forward_order.clear()
        if not self.groups:
            return
        if recompute:
            for group in self.groups:
                group.wait_for_unshard()
            return
        # The next modules of a group of several prefetch nothing: the first one did.
        first_in_pass = self.training_state is not TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        for group in self.groups:  # every mesh's all-gather in flight before the first wait
            ctx.prefetched.discard(group)  # in use from now on
            if group.early is not None:
                group.early.before_forward()
            group.unshard(async_op=True)
        if first_in_pass:  # in flight while this group computes
            ctx.prefetch(self._forward_prefetch_targets())
        for group in self.groups:
            if not group.wait_for_unshard():  # (which follows them when it gathers)
                group.refresh_requires_grad()  # frozen or unfrozen since the last forward
            if group.early is not None and torch.is_grad_enabled():
                group.early.forward_started()
            if group not in ctx.forward_order:
                ctx.forward_order.append(group)

    def _make_post_forward_hook(self, module: nn.Module):
        def hook(_module: nn.Module, _args: tuple, output: Any) -> Any:
            if module in self._modules_to_run:
                self._modules_to_run.discard(module)
                if not self._modules_to_run:
                    return self.post_forward(output)
                if self._standalone_part():
                    self._modules_to_run.clear()  # each standalone call is a pass of its own
                    return self.post_forward(output, standalone_part=True)
            return self._cast_output(output)
        return hook

    def _standalone_part(self) -> bool:
        """Whether a module of this group just ran outside the root's forward, the rest not.

        A chunked loss calls the head of a ``[norm, head]`` group once per chunk after the
        root's forward skipped it. Nothing would complete such a pass (no root post-forward
        follows), so the call completes it itself (``standalone_part`` in ``_post_forward``).
        """
        ctx = self.ctx
        return ctx is not None and not ctx.in_forward and not _compat.in_backward()

    def post_forward(self, output: Any, standalone_part: bool = False) -> Any:
        if self.ctx is None:  # forward raised before lazy init finished
            return output
        # Forward hooks registered with always_call also run when forward raised: then
        # there is no output and the exception is being handled.
        if output is None and sys.exc_info()[1] is not None:
            self._post_forward_after_exception()
            return output
        try:
            return self._post_forward(output, standalone_part)
        except BaseException:
            self.ctx.interrupted = True
            raise

    def _post_forward_after_exception(self) -> None:
        """Forward raised: free what needs no collective; the next root forward resets the rest.

        An all-gather still in flight is not waited for: after a failure the ranks'
        collectives may no longer pair up, and waiting could hang instead of letting the
        error reach the user.
        """
        if _compat.in_backward():  # recomputation: the backward fails too, and is reset
            return
        for group in self.groups:
            if group.state is not ShardState.GATHERING:
                group.reshard()
        self.training_state = TrainingState.IDLE
        if self.is_root:
            self.ctx.in_forward = False
            self.ctx.interrupted = True

    def _post_forward(self, output: Any, standalone_part: bool = False) -> Any:
        """Reshard per policy and hook the outputs for backward; the root also completes
        the groups its forward ran in part.

        ``standalone_part``: a call outside the root's forward ran some of the group's modules
        only (``_standalone_part``). As in torch, the group stays gathered for the backward that
        follows such a call (a chunked loss's next step) and is resharded after it; that
        backward stops at the call's inputs, so its hook prefetches nothing and its end
        finishes only the groups it reached (``RootContext.local_backward``).
        """
        recompute = _compat.in_backward()
        if self.groups and not recompute:
            grad_outputs = [t for t in iter_tensors(output) if t.requires_grad]
            backward_follows = torch.is_grad_enabled() and bool(grad_outputs)
            with _compat.outside_functorch():
                for group in self.groups:
                    if not (standalone_part and backward_follows):
                        self._reshard_after_forward(group, backward_follows)
                    if backward_follows and group.early is not None:
                        group.early.forward_done()
            if backward_follows:
                hook = self._standalone_pre_backward_hook if standalone_part else self._pre_backward_hook
                if len(grad_outputs) == 1:  # the first gradient is its only one: a tensor hook is the same, cheaper
                    grad_outputs[0].register_hook(hook)  # (the hook returns None: the gradient is unchanged)
                else:
                    torch.autograd.graph.register_multi_grad_hook(grad_outputs, hook, mode="any")
            elif torch.is_grad_enabled() and _compat.functorch_active():
                output = map_tensors(self._hook_output_under_transform, output)
            self.training_state = TrainingState.IDLE
        if self.is_root and not recompute:
            self.ctx.in_forward = False
            self.ctx.shape_inference = False
            with _compat.outside_functorch():
                for state in self.ctx.states:  # a prefetch this forward never used: free it
                    for group in state.groups:
                        if group.state is ShardState.GATHERING:
                            group.reshard()
            output = self._complete_partial_passes(output)
        return self._cast_output(output)

    def _complete_partial_passes(self, output: Any) -> Any:
        """At the root's post-forward: finish each group whose forward ran some of its modules.

        A chunked loss shards ``[norm, head]`` together and runs the head outside the root's
        forward (``model(x, skip_head=True)``): the head's post-forward hook never completes the
        group. As torch, the root completes it on its own output: the group reshards per
        policy, its pre-backward hook goes on the root's outputs and its ``output_dtype``
        applies to them. Deepest groups first, as their post-forwards would have run.
        """
        for state in reversed(self.ctx.states):
            if state is not self and state._modules_to_run:
                state._modules_to_run.clear()
                output = state.post_forward(output)
        return output

    def _hook_output_under_transform(self, t: torch.Tensor) -> torch.Tensor:
        """``torch.func``: a floating output may take part in a backward outside the transform."""
        return PreBackward.apply(self, t) if t.is_floating_point() or t.is_complex() else t

    def _reshard_after_forward(self, group: ParamGroup, backward_follows: bool) -> None:
        if not backward_follows and not self.ctx.shape_inference:
            group.reshard()  # no backward can follow: never leave full parameters behind
        elif all(m.training for m in self.modules):
            group.reshard_after_forward_step()
        else:  # eval: backward is unlikely; if it comes, the hook gathers again
            group.reshard()

    def _cast_output(self, output: Any) -> Any:
        dtype = self.mp_policy.output_dtype
        return output if dtype is None else cast_floating(output, dtype)

    def _hook_inputs_grad_ready(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Route the inputs that require grad through ``InputsGradReady`` (see there)."""
        tensors = [t for t in iter_tensors((args, kwargs)) if t.requires_grad]
        waiting = [group for group in self.groups if group.waits_for_inputs]
        if not tensors:  # e.g. token ids: the end of backward reduces this group
            for group in waiting:
                group.unhooked_forward = True
            return args, kwargs
        token = Pending()
        for group in waiting:  # (the others ignore it: inputs_grad_ready finds it in none of theirs)
            group.inputs_pending.add(token)
        aliases = dict(zip(map(id, tensors), InputsGradReady.apply(self._inputs_grad_ready, token, *tensors)))
        return map_tensors(lambda t: aliases.get(id(t), t), (args, kwargs))

    # ---- backward -----------------------------------------------------------------------
    def _pre_backward(self, _grad: torch.Tensor, standalone: bool = False) -> None:
        _compat.refuse_compiled_autograd()
        ctx = self.ctx
        if not ctx.callback_queued:
            ctx.callback_queued = True
            ctx.local_backward = standalone
            _compat.queue_end_of_backward_callback(self._end_of_backward_callback)
        elif not standalone:  # this backward reaches a forward of the root's: finish them all
            ctx.local_backward = False
        self.training_state = TrainingState.BACKWARD
        for group in self.groups:
            ctx.prefetched.discard(group)
            group.pre_backward()  # first: its wait checks that the ranks run the same schedule
        if standalone:  # the backward of a standalone call: nothing before it to prefetch or free
            return
        for early in ctx.early:  # backward moved on: what is final there is reduced (and freed)
            if early.group not in self.groups:
                early.backward_reached()
        ctx.prefetch(self._backward_prefetch_targets())

    def _forward_prefetch_targets(self) -> list[ParamGroup]:
        """Explicit targets, else the module that ran after this one last iteration (its groups).

        Not for a call outside the root's forward (a chunked loss's head): the order of the
        root's forward says nothing of what runs after it.
        """
        if self.forward_prefetch:
            return [g for s in self.forward_prefetch for g in s.groups]
        order = self.ctx.last_forward_order
        if self.implicit_prefetch and self.ctx.in_forward and self.groups and self.groups[-1] in order:
            index = order.index(self.groups[-1])
            if index + 1 < len(order):
                return self._groups_of_state_at(order, index + 1)
        return []

    def _groups_of_state_at(self, order: list[ParamGroup], index: int) -> list[ParamGroup]:
        """The groups of the module state that ``order[index]`` belongs to, in ``order``'s order."""
        state = self.ctx.state_of.get(order[index])
        return [g for g in order if self.ctx.state_of.get(g) is state]

    def _backward_prefetch_targets(self) -> list[ParamGroup]:
        return [g for g in self._backward_prefetch_candidates() if g.policy.unshard_in_backward]

    def _backward_prefetch_candidates(self) -> list[ParamGroup]:
        """The module backward reaches next: its groups in backward's order (the last first)."""
        if self.backward_prefetch:  # an empty list means implicit, as in torch
            return [g for s in self.backward_prefetch for g in reversed(s.groups)]
        if not self.implicit_prefetch or not self.groups:
            return []
        order = self.ctx.forward_order
        if self.is_root:  # backward leaves the root's own layers for the last module that ran
            if not order or order[-1] in self.groups:
                return []
            return list(reversed(self._groups_of_state_at(order, len(order) - 1)))
        if self.groups[0] in order:
            index = order.index(self.groups[0])
            # A group already reduced this backward (e.g. a root holding only the output head)
            # needs no parameters again: gathering it would be a wasted all-gather.
            if index > 0 and not order[index - 1].post_backward_done:
                return [g for g in reversed(self._groups_of_state_at(order, index - 1)) if not g.post_backward_done]
        return []

    def _end_of_backward(self) -> None:
        ctx = self.ctx
        ctx.callback_queued = False
        local, ctx.local_backward = ctx.local_backward, False
        try:
            # Last-run groups first: the order backward reached them, the same on every rank.
            for state in reversed(ctx.states):
                if local and not any(group.backward_started for group in state.groups):
                    continue  # waits for the backward of the root's forward
                for group in reversed(state.groups):  # backward's order, as torch's
                    if not group.backward_started and not group.policy.requires_gradient_sync:
                        # As torch's end of backward: gradients set outside backward (pipelining's
                        # weight pass) are kept in reduce dtype before the next one adds to them.
                        for p in group.params:
                            p.stash_unsynced_grad()
                    group.end_backward(forwards_done=not local)
                state.training_state = TrainingState.IDLE
                state._modules_to_run.clear()  # e.g. a forward recomputed for part of a group
            if ctx.is_last_backward:
                ctx.reduce_queue.drain()
            else:  # the finished ones' results are complete before backward returns (CUDA)
                ctx.reduce_queue.land()
        except BaseException:
            ctx.interrupted = True
            raise
        if ctx.is_last_backward:  # the iteration is complete: the module stays usable if this raises
            _checks.raise_if_nonfinite(ctx)

    # ---- recovery -----------------------------------------------------------------------
    def _recover_if_interrupted(self) -> None:
        """At a new root forward: reset an iteration an exception left half-done.

        Signs: the last root forward raised (or one of fsdp2's own steps after it), or a
        backward queued its end-of-backward callback and never ran it (it raised; the engine
        drops the callback). Two forwards before one backward (gradient accumulation) and
        forwards re-run inside backward (activation checkpointing) are neither.
        """
        ctx = self.ctx
        if not self.is_root or ctx is None or _compat.in_backward():
            return
        if not ctx.interrupted and not (ctx.callback_queued and not ctx.in_forward):
            return
        where = "backward" if ctx.callback_queued else "forward"
        logger.warning(
            "fsdp2: step %d of %s was interrupted by an exception in %s and reset_iter_state() "
            "was not called; resetting it now: collectives in flight are waited for and their "
            "results dropped, unsharded parameters and gradients freed",
            ctx.iteration + 1, type(self.modules[0]).__name__, where,  # steps count from 1, as a loop's
        )
        self.reset_iter_state(discard_reductions=True)

    def reset_iter_state(self, discard_reductions: bool = False) -> None:
        states = self.ctx.states if self.ctx is not None else [self]
        if self.ctx is not None:
            self.ctx.callback_queued = False
            self.ctx.local_backward = False
            self.ctx.in_forward = False
            self.ctx.interrupted = False
            if discard_reductions:  # the user may have zeroed .grad since: adding to it now would be wrong
                self.ctx.reduce_queue.discard()
            else:
                self.ctx.reduce_queue.drain()
            if self.ctx.diag is not None:
                self.ctx.diag.nonfinite.clear()
        for state in states:
            for group in state.groups:
                group.reset()
            state.training_state = TrainingState.IDLE
            state._modules_to_run.clear()


def _mesh_name(group: ParamGroup) -> str:
    """A group's mesh in labels: its axis names, or its size."""
    names = group.dp.mesh.mesh_dim_names
    return ",".join(names) if names else f"{group.world} ranks"
