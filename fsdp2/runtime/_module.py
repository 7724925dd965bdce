"""``FSDPModule``: the methods a ``fully_shard``-ed module gains.

``fully_shard`` swaps a module's class to a dynamically made ``FSDP<Class>``
deriving from ``(FSDPModule, Class)``, so ``isinstance(m, FSDPModule)`` holds
and these methods are available while everything else behaves as before.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, NoReturn

import torch
import torch.nn as nn

import torch.distributed as dist

from ..comm import _comm
from ..comm._comm import AllGather, ReduceScatter
from .._common import ShardState
from .._errors import FSDPTypeError, FSDPValueError
from ._state import ModuleState, get_state

__all__ = ["FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``; ``wait()`` finishes the all-gather.

    Waiting is optional: the module's next forward waits anyway.
    """

    def __init__(self, state: ModuleState | None = None) -> None:
        self._state = state

    def wait(self) -> None:
        # Only a gather still in flight: once a forward has used (and maybe freed) the
        # parameters, waiting must not gather them again (torch's handle is a no-op then too).
        for group in self._state.groups if self._state is not None else ():
            if group.state is ShardState.GATHERING:
                group.wait_for_unshard()
        self._state = None


class FSDPModule:
    def __new__(cls, *args: Any, **kwargs: Any):
        # ``fully_shard`` only ever enters an FSDP<Class> by swapping ``__class__``. Calling one
        # is code building a sibling of a sharded module with ``type(module)(...)``
        # (``nn.Sequential`` slicing, ``ModuleList`` copies): that gets a plain, unsharded
        # instance of the class the user wrote, the first one up the MRO that is no FSDPModule.
        written = next(base for base in cls.__mro__ if not issubclass(base, FSDPModule))
        if written is object:
            raise TypeError("FSDPModule is not made directly: fully_shard(module) makes a module one")
        return written(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> NoReturn:
        # A copy would share the original's groups, buffers and hooks (or, through ``__new__``,
        # lose them): refused up front, as torch's FSDP2 does (an AssertionError there).
        raise FSDPValueError(
            f"fsdp2: FSDP does not support deepcopy ({type(self).__name__} is fully_shard-ed); copy its "
            "weights through the state dict instead, e.g. build a new model, fully_shard it the same way "
            "and call new.load_state_dict(model.state_dict()), or deepcopy the model before fully_shard"
        )

    def _fsdp_state(self) -> ModuleState:
        state = get_state(self)
        if state is None:
            raise RuntimeError(f"{type(self).__name__} has no fsdp2 state; was fully_shard undone?")
        return state

    def _states_below(self, recurse: bool) -> list[ModuleState]:
        if not recurse:
            return [self._fsdp_state()]
        states: list[ModuleState] = []
        for module in self.modules():
            state = get_state(module)
            if state is not None and state not in states:
                states.append(state)
        return states

    # ---- explicit unshard / reshard -----------------------------------------------------
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (not recursive).

        With ``async_op=True`` returns an :class:`UnshardHandle`; the next
        forward waits for it if ``wait()`` was not called.
        """
        state = self._fsdp_state()
        # No lazy init here: this module may be a sub-module called before the root's first
        # forward, and must not become a root itself.
        for group in state.groups:  # async: the caller's code runs before the wait (send_aliases_shards)
            group.prepare()
            group.unshard(async_op=True, explicit=async_op)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters; the module holds shards again (not recursive)."""
        for group in self._fsdp_state().groups:
            group.reshard()

    # ---- policies -----------------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Turn gradient reduction off for accumulation steps, on for the last one.

        While off, gradients accumulate unsharded on each rank with no
        communication; the next synced backward reduce-scatters the sum.
        """
        _check_bool("requires_gradient_sync", requires_gradient_sync)
        for state in self._states_below(recurse):
            for group in state.groups:
                group.policy.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: skip (False) or do (True) the all-reduce across replicas after reduce-scatter.

        For gradient accumulation that still reduce-scatters within each
        replica but saves the slower cross-replica traffic until the last
        micro-batch; the skipped sums are kept and all-reduced then.
        """
        _check_bool("requires_all_reduce", requires_all_reduce)
        for state in self._states_below(recurse):
            for group in state.groups:
                group.policy.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """If False, the end of backward does not wait for the last reduce-scatters."""
        _check_bool("is_last_backward", is_last_backward)
        state = self._fsdp_state()
        state.lazy_init()
        state.ctx.is_last_backward = is_last_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free parameters after forward (True) or keep them for backward (False)."""
        _check_bool("reshard_after_forward", reshard_after_forward)
        for state in self._states_below(recurse):
            for group in state.groups:
                group.policy.reshard_after_forward = reshard_after_forward
            state.auto_reshard_after_forward = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Free parameters after backward (True, default) or keep them (e.g. between microbatches)."""
        _check_bool("reshard_after_backward", reshard_after_backward)
        for state in self._states_below(recurse):
            for group in state.groups:
                group.policy.reshard_after_backward = reshard_after_backward

    def set_early_release(self, enabled: bool) -> None:
        """Free this module's parameters a part at a time before the end of backward (opt-in).

        For a module that holds other sharded modules (the root: embeddings, final norm and
        output head around the sharded blocks). By default, as in torch's FSDP2, it keeps all its
        parameters unsharded from forward to the end of backward (backward reduces each of its
        gradients once it is final either way). With this on, its unsharded buffer is one
        storage per module owning its parameters, and a part is freed (its modules hold the
        sharded DTensors again):

        * after forward, when forward took no reference to it (an embedding table: its backward
          reads the indices only);
        * in backward, from the second step on, once its gradients are final and no tensor
          autograd saved holds it any more (the output head, once backward reaches the blocks).

        A forward re-run in backward (activation checkpointing) and ``unshard()`` gather it whole
        again; two forwards per backward stop the frees after forward (one all-gather per step).

        Limits: code that reads a freed parameter through its module finds the sharded DTensor
        there: a penalty on a root weight added to the loss after forward, or a custom
        ``autograd.Function`` reading ``ctx.module.weight`` in backward, fails with "mixed
        torch.Tensor and DTensor"; a kernel keeping a raw pointer would read freed memory. Call
        it before the module's first forward (the buffer is cut when first allocated); it has no
        effect on a module that holds no other sharded module.
        """
        _check_bool("enabled", enabled)
        for group in self._fsdp_state().groups:
            group.set_early_release(enabled)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """Reduce a zero gradient for every trainable parameter that got none on this rank.

        For ranks that use different parameters (mixture of experts, branches on the data),
        as DDP's ``find_unused_parameters``: every rank then reduces every trainable
        parameter's gradient, so the reduce-scatters match, and a parameter gets the average
        of the gradients the ranks produced, counting zeros where they produced none (a zero
        gradient, not None, where no rank produced one). A group with this on reduces at the
        end of its module's backward (when the gradients of the module's inputs are computed),
        the same point on every rank; a group whose inputs need no gradient (the root's token
        ids) at the end of backward.
        """
        _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        for state in self._states_below(recurse):
            for group in state.groups:
                group.policy.reduce_unused = reduce_scatter_unused_params

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward gathers this module's parameters again (True, default).

        False when backward needs none of their values, e.g. an embedding (its gradient
        needs only the indices): the group resharded after forward is not gathered for
        backward, by its own hook or by a prefetch; its gradients are reduced as usual.
        A backward that does need the values then fails (their storage is freed).
        """
        _check_bool("unshard_in_backward", unshard_in_backward)
        for group in self._fsdp_state().groups:
            group.policy.unshard_in_backward = unshard_in_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters right after this module's, in forward."""
        self._fsdp_state().forward_prefetch = _states_of("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters when backward reaches this one.

        Replaces the implicit choice (the module that ran just before in forward);
        an empty list restores it, as in torch.
        """
        self._fsdp_state().backward_prefetch = _states_of("set_modules_to_backward_prefetch", modules)

    def set_implicit_prefetch(self, enabled: bool, *, recurse: bool = True) -> None:
        """Turn the implicit prefetch schedule on (default) or off.

        On: in forward, each group issues the all-gather of the group that ran
        after it in the previous iteration before computing; in backward, of
        the group that ran before it. At most one extra group is unsharded at
        a time. Off: groups gather only when reached (and explicit
        ``set_modules_to_*_prefetch`` lists still apply). Not in torch's FSDP2.
        """
        _check_bool("enabled", enabled)
        for state in self._states_below(recurse):
            state.implicit_prefetch = enabled

    def set_prefetch_limit(self, limit: int | None) -> None:
        """Cap how many groups may be gathered ahead of their use at once.

        Applies to implicit and explicit prefetches alike under this module's
        root: a prefetch beyond the cap is skipped and that group is gathered
        when forward or backward reaches it. ``None`` (default): no cap (the
        implicit schedule prefetches one group ahead; explicit
        ``set_modules_to_*_prefetch`` lists are honoured in full). ``0``: no
        prefetching at all. Bounds the unsharded-parameter memory at the
        current group plus ``limit`` prefetched ones (plus groups kept
        unsharded on purpose, such as a root that does not reshard after
        forward). Not in torch's FSDP2.
        """
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"set_prefetch_limit: limit must be None or an int >= 0, got {limit!r}")
        for below in self._states_below(recurse=True):
            below.prefetch_limit = limit
            if below.ctx is not None:
                below.ctx.prefetch_limit = limit

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel world size."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be a positive number, got {factor!r}")
        for state in self._states_below(recurse=True):
            for group in state.groups:
                group.policy.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated (as in torch): use :meth:`set_gradient_divide_factor`."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
                      DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with ``SUM`` only (then divide), never the backend's ``AVG``: this module's group.

        For backends whose fast paths exist only for sums. The exchanges fsdp2 uses on CPU
        always sum; the flat collectives (NCCL, small CPU groups) and the HSDP all-reduce
        use ``AVG`` for fp32 and bf16 gradients unless this is on.
        """
        _check_bool("enable", enable)
        for group in self._fsdp_state().groups:
            group.policy.force_sum = enable

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: torch.cuda.Stream | None = None) -> None:
        """Run ``hook(reduced)`` on each reduced gradient shard of this module's group.

        ``reduced`` is flat, in the reduce dtype, after the reduce-scatter (and HSDP's
        all-reduce) and the division; the hook may change it in place (e.g. all-reduce it
        over a dimension of its own) before it is added into ``.grad``. ``stream`` (CUDA,
        not with HSDP, as in torch): run the hook there, ordered after the reduction and
        before the gradients are used. Not recursive, as in torch.
        """
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook: hook must be callable, got {type(hook).__name__}")
        group = _one_group(self, "set_all_reduce_hook", "the hook")
        if stream is not None:
            if group is not None and group.dp.replicate_group is not None:
                raise ValueError("set_all_reduce_hook: stream cannot be set with HSDP (a 2-D mesh); "
                                 "the hook runs after the all-reduce across replicas")
            if group is None or group.device.type != "cuda":
                raise ValueError("set_all_reduce_hook: stream is for CUDA meshes; leave it None")
        if group is not None:
            group.policy.all_reduce_hook = (hook, stream)

    def set_post_optim_event(self, event: torch.Event | None) -> None:
        """Accepted for compatibility; fsdp2 does not need it.

        torch lets the root's first all-gather of the next step wait on ``event`` (recorded
        after the optimizer step) instead of on the current stream. fsdp2 always orders
        that all-gather after the current stream, which includes the optimizer step: always
        correct, possibly later than the event would allow. ``None`` is what torch does
        without an event, and what ``torch.get_device_module("cpu").current_stream()
        .record_event()`` returns: accepted as in torch.
        """
        if event is None:
            return
        if not (callable(getattr(event, "record", None)) and callable(getattr(event, "wait", None))):
            raise TypeError(
                f"set_post_optim_event: event must be a torch.Event or None, got {type(event).__name__}")

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Allocate and run this module's all-gather with ``comm`` (not recursive, as in torch).

        ``comm.allocate(size, *, dtype, device)`` returns the output buffer (1-D, ``uint8``:
        fsdp2 gathers bytes) and ``comm(output_tensor, input_tensor, group, async_op)`` fills it
        with every rank's ``input_tensor`` back to back, returning a work handle or None. The
        interface of torch's ``AllGather``: objects written for torch work unchanged. The group's
        all-gather then runs flat on CPU too (the exchanges have no single collective to replace).
        """
        self._set_custom_comm("all_gather", comm)

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Allocate and run this module's reduce-scatter with ``comm`` (not recursive, as in torch).

        ``comm.allocate(size, *, dtype, device)`` returns the input (rank-major, 1-D) and output
        buffers in the reduce dtype; ``comm(output_tensor, input_tensor, group, op, async_op)``
        reduces chunk ``r`` of the input over the ranks into rank ``r``'s output with ``op``
        (``AVG`` or ``SUM``). The group's reduce-scatter then runs flat on CPU too.
        """
        self._set_custom_comm("reduce_scatter", comm)

    def _set_custom_comm(self, kind: str, comm: Any) -> None:
        _comm.check_comm(f"set_custom_{kind}", comm)
        group = _one_group(self, f"set_custom_{kind}", "the custom comm")
        if group is not None and kind == "reduce_scatter" and group.policy.grad_block:
            raise ValueError(
                f"fsdp2: set_custom_reduce_scatter: {group.label} reduces its gradients quantized "
                f"(QuantizedComm(gradients='int{group.policy.grad_bits}'): an all-to-all of quantized values), "
                "which a custom reduce-scatter cannot run; shard it with gradients=None to use a custom reduce-scatter"
            )
        if group is not None:
            setattr(group.policy, f"custom_{kind}", comm)
            group.policy.allocate_from_process_group = False  # the custom comm allocates
            group.refresh_transports()

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate this module's flat communication buffers with the process group's allocator.

        Where the backend has one (NCCL can then register the memory for zero-copy transfers);
        gloo has none, so on CPU nothing changes. Not with custom comms (``ValueError``).
        """
        _check_bool("enable", enable)
        groups = self._fsdp_state().groups
        for group in groups:
            _no_custom_comms("set_allocate_memory_from_process_group_for_comm", group)
        for group in groups:
            group.policy.allocate_from_process_group = enable
            group.refresh_transports()

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Not supported: fsdp2 does not allocate from symmetric memory.

        ``ValueError`` off CUDA (it needs NCCL); ``NotImplementedError`` on CUDA, naming the way
        to get it: :meth:`set_custom_all_gather` with a comm whose ``allocate`` uses the
        symmetric-memory pool.
        """
        groups = self._fsdp_state().groups
        group = groups[0] if groups else None
        if group is None or group.device.type != "cuda":
            device = group.device.type if group is not None else "no parameters"
            raise ValueError(f"set_symm_mem_for_comm: symmetric memory needs CUDA with NCCL; this module has "
                             f"{device}")
        raise NotImplementedError(
            "set_symm_mem_for_comm: fsdp2 does not allocate from symmetric memory; pass set_custom_all_gather a "
            "comm whose allocate() uses torch.distributed._symmetric_memory's memory pool instead"
        )

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reduce-scatters may stay in flight after this module's group issues its own.

        Before a group issues a reduce-scatter, fsdp2 waits for the oldest ones still in flight
        until fewer than ``max_input_buffers`` are left (default: 1 for flat collectives, as in
        torch; 2 for CPU exchanges): each one in flight holds its gradients and buffers, so a
        higher number trades memory for fewer waits in backward when the reductions are slower
        than the compute. The end of backward waits for them all.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"set_reduce_scatter_max_input_buffers: max_input_buffers must be an int, got "
                            f"{type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"set_reduce_scatter_max_input_buffers: max_input_buffers must be >= 1, got "
                             f"{max_input_buffers}")
        for state in self._states_below(recurse):
            for group in state.groups:
                group.policy.max_reduce_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Reduce-scatter on a process group of its own (True), or on the all-gather's (False).

        One new process group per set of shard ranks (typically one for the whole model), so a
        reduce-scatter and the next all-gather in backward progress independently (on gloo:
        their own connections and threads). Collective: call it on every rank, at the same
        point, as ``fully_shard``.
        """
        _check_bool("enable", enable)
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in (g for state in self._states_below(recurse) for g in state.groups):
            if group.world == 1:
                continue
            if not enable:
                group.set_reduce_group(None)
            elif group.policy.reduce_group is None:
                ranks = tuple(dist.get_process_group_ranks(group.process_group))
                if ranks not in made:
                    made[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
                group.set_reduce_group(made[ranks])

    def set_check_finite_gradients(self, enabled: bool = True, *, recurse: bool = True) -> None:
        """Raise ``FloatingPointError`` on every rank when a reduced gradient is NaN or infinite.

        Off by default. When on, each reduced gradient shard of the groups under this module
        is checked as its reduce-scatter finishes; at the end of backward one small
        all-reduce per mesh axis agrees on the first non-finite parameter (in the order
        gradients were reduced) and every rank raises, naming it, the iteration and how
        many elements were non-finite on which ranks. It raises after every reduction
        finished, so the module stays usable: ``optimizer.zero_grad()`` and go on. Costs a
        few small kernels per parameter, one all-reduce per backward and, on CUDA, a sync.
        Not in torch's FSDP2.
        """
        _check_bool("enabled", enabled)
        for state in self._states_below(recurse):
            for group in state.groups:
                group.policy.check_finite = enabled

    def reset_iter_state(self) -> None:
        """Recover after an exception inside forward or backward.

        Waits for collectives in flight, reshards every group under the root,
        drops half-accumulated unsharded gradients and clears per-iteration
        state so the next forward starts clean. Sharded ``.grad`` values are
        left to the caller (``optimizer.zero_grad()``). The next root forward
        does this by itself when it finds the previous iteration interrupted.
        """
        self._fsdp_state().reset_iter_state()

    # ---- conversions --------------------------------------------------------------------
    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # Shards must be registered while torch converts them; afterwards the
        # padded storage is rebuilt from whatever the conversion produced.
        groups = self._fsdp_state().groups
        for group in groups:
            group.reshard()
        out = super()._apply(*args, **kwargs)
        for group in groups:
            group.adopt_registered(False, "after a module conversion: to_empty(), to(), float(), ...")
            group.find_extensions()  # the local tensors are new objects
        return out


def _one_group(module: FSDPModule, method: str, what: str) -> Any:
    """The module's parameter group, for the setters that take one (as torch's, which refuse several)."""
    state = module._fsdp_state()
    if len(state.groups) > 1:
        raise FSDPValueError(
            f"{method}: {state.label()} has {len(state.groups)} parameter groups, one per mesh (shard_placement_fn "
            f"put its parameters on several meshes), and {what} would be ambiguous across them, as in torch; "
            "shard the parameters of each mesh in a fully_shard call of their own to set it per mesh"
        )
    return state.group


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise FSDPTypeError(f"{name} must be a bool, got {value!r}")


def _no_custom_comms(method: str, group: Any) -> None:
    custom = [name for name, comm in (("set_custom_all_gather", group.policy.custom_all_gather),
                                      ("set_custom_reduce_scatter", group.policy.custom_reduce_scatter))
              if comm is not None]
    if custom:
        raise FSDPValueError(f"{method}: {group.label} has a custom comm ({', '.join(custom)}), which allocates its "
                             "own buffers; allocate from the process group inside the custom comm instead")


def _states_of(method: str, modules: list[Any]) -> list[ModuleState]:
    states = []
    for module in modules:
        state = get_state(module) if isinstance(module, nn.Module) else None
        if state is None:
            raise FSDPTypeError(f"{method}: expected modules passed to fully_shard, got {type(module).__name__}")
        states.append(state)
    return states


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) unshard and reshard like ``forward``.

    Without this, calling a method other than ``forward`` on a sharded module
    would see DTensor shards instead of full parameters.
    """
    state = get_state(module)
    if state is None:
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} is not fully_shard-ed; "
            "call fully_shard(module) first"
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return state.run_forward_method(module, method, args, kwargs)

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[Any]) -> None:
    """Let several roots share one communication context (torch: CUDA streams, e.g. for pipeline stages).

    fsdp2 already keeps one set of side streams per device for every group of every root
    (``_streams.py``), so there is nothing to share; checks that each module was passed to
    ``fully_shard`` (``ValueError`` otherwise, as torch).
    """
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"share_comm_ctx: expected modules passed to fully_shard, got {type(module).__name__}")
