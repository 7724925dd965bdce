"""``MemoryTracker``: where a rank's memory went, by category, at the peak and now.

On CPU every live tensor storage is counted (see ``_live.py``); at each new peak the live
storages are sorted into categories by identity against what the model and optimizer hold
at that moment. On CUDA the allocator's own statistics give the total and the peak; the
categories come from the same identity pass over the live storages the dispatch mode saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ..diagnostics import _trace
from .._compat import in_backward, prepend_post_accumulate_grad_hook
from .._common import ShardState
from ..runtime._state import get_state
from ._live import LiveStorages, aliases, plain_tensors, storage_key

if TYPE_CHECKING:
    from ..runtime._group import ParamGroup

__all__ = ["CATEGORIES", "MemoryReport", "MemoryTracker", "format_bytes"]

CATEGORIES = (
    "sharded_params", "unsharded_params", "gradients", "optimizer_state",
    "activations", "communication", "other",
)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


@dataclass
class MemoryReport:
    """Bytes of one rank, by category, at the peak and at the end of the tracked region.

    ``peak_phase`` is "forward", "loss" (after the model's forward, before its backward),
    "backward" or "outside" (e.g. the optimizer step). ``peak_unsharded_groups`` names the
    fsdp2 groups (module FQNs) whose full parameters were live or being gathered at the
    peak; ``peak_by_group`` gives, for every group holding more than its shards then, its
    state and the bytes of its unsharded parameters and communication buffers.
    """

    peak_bytes: int
    peak_by_category: dict[str, int]
    current_bytes: int
    current_by_category: dict[str, int]
    peak_phase: str
    peak_unsharded_groups: list[str] = field(default_factory=list)
    peak_by_group: dict[str, dict[str, int | str]] = field(default_factory=dict)
    device_peak_bytes: int | None = None  # CUDA allocator's peak, when on CUDA

    def table(self) -> str:
        rows = [(c, format_bytes(self.peak_by_category[c]), format_bytes(self.current_by_category[c]))
                for c in CATEGORIES]
        rows.append(("total", format_bytes(self.peak_bytes), format_bytes(self.current_bytes)))
        text = format_table(rows, ("category", "at peak", "now"))
        text += f"\npeak during {self.peak_phase}"
        if self.peak_by_group:
            group_rows = [(label, str(g["state"]), format_bytes(g["unsharded_params"]),
                           format_bytes(g["communication"]))
                          for label, g in self.peak_by_group.items()]
            text += "; fsdp2 groups holding more than their shards at the peak:\n"
            text += format_table(group_rows, ("group", "state", "unsharded_params", "communication"))
        else:
            text += "; no fsdp2 group held more than its shards"
        if self.device_peak_bytes is not None:
            text += f"\nCUDA allocator peak: {format_bytes(self.device_peak_bytes)}"
        return text

    __str__ = table


class MemoryTracker:
    """Context manager counting this rank's live tensor memory by category.

    Storages that exist when the context is entered (parameters, optimizer state) are
    registered from ``model`` and ``optimizer``; everything an op creates inside the context
    is registered as it is born. At each new peak every live storage is put in one category:

    * by identity, against what fsdp2 and the optimizer hold at that moment: sharded
      parameters, unsharded parameters (fsdp2's unsharded buffers, and parameters fsdp2
      does not manage), gradients (sharded, unsharded, accumulated), optimizer state,
      communication buffers (all-gathers and reduce-scatters in flight);
    * a storage that once was a parameter's ``.grad`` stays a gradient until it dies (so
      full gradients being copied into a reduce-scatter still count as gradients), and one
      seen as a communication buffer at one of fsdp2's schedule events stays one (so a
      reduce-scatter being finished, already out of the queue, is still communication);
      one that an op first takes as an input during backward, before any op made it, was
      allocated out of sight by a collective (gloo) and is communication too;
    * anything else born between the start of the model's forward and the end of the
      backward that follows (loss included) is an activation; the rest is "other".

    Args:
        model: the (root) module; its fsdp2 groups and plain parameters are classified.
        optimizer: its ``state`` tensors count as optimizer state.

    Notes: the CPU accounting sees tensors only (not gloo's or the allocator's private
    buffers) and each storage's full size (a view of a large tensor keeps it all alive).
    Tracking costs a Python call per op; use it for a few diagnostic steps.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self._live = LiveStorages(on_peak=self._snapshot_peak, resizable=self._resizable)
        self._live.count_meta = False
        self._live.tag = self._birth_label
        self._forward_depth = 0
        self._in_iteration = False  # between the model's forward and the end of its backward
        self._saw_backward = False
        self._issuing = False  # between fsdp2's "begin <collective>" and "end <collective>" events
        self._handles: list = []
        self._hooked: set[int] = set()
        self._peak: tuple[dict[str, int], str, dict[str, dict[str, int | str]]] = (
            {c: 0 for c in CATEGORIES}, "outside", {})
        self.report: MemoryReport | None = None

    # ---- what fsdp2 and the optimizer hold -----------------------------------------------
    def _groups(self) -> list[ParamGroup]:
        groups = []
        for module in self.model.modules():
            state = get_state(module)
            for group in state.groups if state is not None else ():
                if group not in groups:
                    groups.append(group)
        return groups

    def _resizable(self) -> list[torch.UntypedStorage]:
        """Storages fsdp2 may resize in place (no op the dispatch mode sees creates them)."""
        return [t.untyped_storage() for g in self._groups()
                for c in ("unsharded_params", "communication") for t in g.held_tensors()[c]]

    def _roles(self) -> dict[int, str]:
        """Storage key -> category for everything the model, fsdp2 and optimizer hold now."""
        roles: dict[int, str] = {}

        def mark(t: torch.Tensor | None, role: str) -> None:
            if isinstance(t, torch.Tensor):
                for plain in plain_tensors(t):
                    key = storage_key(plain)
                    if key is not None:
                        roles.setdefault(key, role)

        managed: set[int] = set()
        for g in self._groups():
            for category, tensors in g.held_tensors().items():
                for t in tensors:
                    mark(t, category)
            for p in g.params:
                managed.update((id(p.sharded), id(p.unsharded)))
        for p in self.model.parameters():
            if id(p) not in managed:  # not sharded by fsdp2: a full copy on every rank
                mark(p.grad, "gradients")
                mark(p, "unsharded_params")
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for t in state.values():
                    mark(t, "optimizer_state")
        return roles

    def _by_category(self) -> dict[str, int]:
        roles = self._roles()
        labels = self._live.labels
        out = {c: 0 for c in CATEGORIES}
        # A copy: a storage dying while this runs (a garbage collection the loop's own allocations
        # set off) drops out of ``sizes`` in its finalizer.
        for key, nbytes in list(self._live.sizes.items()):
            out[roles.get(key) or labels.get(key) or "other"] += nbytes
        return out

    def _phase(self) -> str:
        if self._forward_depth:
            return "forward"
        if in_backward():
            return "backward"
        return "loss" if self._in_iteration and not self._saw_backward else "outside"

    def _birth_label(self, as_input: bool) -> str | None:
        """Category of a storage first seen now: activations inside an iteration.

        One born while fsdp2 issues a collective is a communication buffer.
        One that first shows up as an op's input during backward was made where no
        dispatch mode sees (gloo's reduce-scatter keeps a full-size copy of its input and
        hands it to ops only when waited on): a communication buffer.
        """
        if in_backward():
            self._saw_backward = True
            if as_input:
                return "communication"
        elif self._saw_backward and not self._forward_depth:  # the backward has ended
            self._in_iteration = self._saw_backward = False
        if self._issuing:
            return "communication"
        return "activations" if self._forward_depth or self._in_iteration else None

    def _by_group(self) -> dict[str, dict[str, int | str]]:
        out = {}
        for g in self._groups():
            sizes, seen = {}, set()
            for category, tensors in g.held_tensors().items():  # each storage once, under its first category
                total = 0
                for t in tensors:
                    key = storage_key(t)
                    if key is not None and key not in seen:
                        seen.add(key)
                        total += t.untyped_storage().nbytes()
                sizes[category] = total
            sizes = {c: sizes[c] for c in ("unsharded_params", "communication")}
            if g.state is not ShardState.SHARDED or any(sizes.values()):
                out[g.label] = {"state": g.state.name, **sizes}
        return out

    def _on_event(self, event: str) -> None:
        if event.startswith("begin "):  # fsdp2 is issuing a collective: what it allocates is communication
            self._issuing = True
            return
        self._issuing = False
        labels, sizes = self._live.labels, self._live.sizes
        for key, role in self._roles().items():
            if role == "communication" and key in sizes and labels.get(key) != "gradients":
                labels[key] = role

    def _snapshot_peak(self) -> None:
        self._peak = (self._by_category(), self._phase(), self._by_group())

    # ---- gradients: remembered from the moment they land ----------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            for plain in plain_tensors(param.grad):
                key = storage_key(plain)
                if key in self._live.sizes:
                    self._live.labels[key] = "gradients"

    def _hook_gradients(self) -> None:
        """Hook every trainable parameter autograd accumulates into (fsdp2's unsharded ones)."""
        params = [p.unsharded for g in self._groups() for p in g.params if p.unsharded is not None]
        managed = {id(p.sharded) for g in self._groups() for p in g.params}
        params += [p for p in self.model.parameters() if id(p) not in managed]
        for p in params:
            if p.requires_grad and id(p) not in self._hooked:
                self._hooked.add(id(p))
                self._handles.append(prepend_post_accumulate_grad_hook(p, self._on_grad))

    # ---- context ----------------------------------------------------------------------
    def _register_existing(self) -> None:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        for g in self._groups():
            tensors += [t for ts in g.held_tensors().values() for t in ts]
        if self.optimizer is not None:
            tensors += [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        for t in aliases(tensors):
            self._live.add_alias(t)
        for t in tensors:
            self._live.add(t)

    def _pre_forward(self, *_args) -> None:
        if not self._forward_depth and not in_backward():
            self._in_iteration, self._saw_backward = True, False
        self._forward_depth += 1

    def _post_forward(self, *_args) -> None:
        self._forward_depth -= 1
        self._hook_gradients()  # fsdp2 creates its unsharded parameters at their first unshard

    def _on_cuda(self) -> bool:
        return any(p.is_cuda for p in self.model.parameters())

    def __enter__(self) -> MemoryTracker:
        self._register_existing()
        self._hook_gradients()
        self._handles += [
            self.model.register_forward_pre_hook(self._pre_forward, prepend=True),
            self.model.register_forward_hook(self._post_forward, always_call=True),
        ]
        if self._on_cuda():
            torch.cuda.reset_peak_memory_stats()
        self._events = _trace.on_event(self._on_event)
        self._events.__enter__()
        self._live.__enter__()
        self._live.check_peak()
        return self

    def __exit__(self, *exc) -> None:
        self._live.__exit__(*exc)
        self._events.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles, self._hooked = [], set()
        self._live.refresh(self._resizable())
        peak_cats, phase, groups = self._peak
        device_peak = torch.cuda.max_memory_allocated() if self._on_cuda() else None
        self.report = MemoryReport(
            peak_bytes=self._live.peak, peak_by_category=peak_cats,
            current_bytes=self._live.total, current_by_category=self._by_category(),
            peak_phase=phase, peak_by_group=groups, device_peak_bytes=device_peak,
            peak_unsharded_groups=[label for label, g in groups.items()
                                   if g["state"] in ("UNSHARDED", "GATHERING")],
        )
