"""``MemoryTracker``: where a rank's memory went, by category, at the peak and now.

On CPU every live tensor storage is counted (see ``_live.py``); at each new peak the live
storages are sorted into categories by identity against what the model and optimizer hold
at that moment. On CUDA the allocator's own statistics give the total and the peak; the
categories come from the same identity pass over the live storages the dispatch mode saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .._compat import in_backward
from .._group import ShardState
from .._state import get_state
from ._live import LiveStorages, plain_tensors, storage_key

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
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


@dataclass
class MemoryReport:
    """Bytes of one rank, by category, at the peak and at the end of the tracked region.

    ``peak_phase`` is "forward", "backward" or "outside" (e.g. the optimizer step);
    ``peak_unsharded_groups`` the fsdp2 groups whose full parameters were live at the peak.
    """

    peak_bytes: int
    peak_by_category: dict[str, int]
    current_bytes: int
    current_by_category: dict[str, int]
    peak_phase: str
    peak_unsharded_groups: list[str] = field(default_factory=list)
    device_peak_bytes: int | None = None  # CUDA allocator's peak, when on CUDA

    def table(self) -> str:
        rows = [(c, format_bytes(self.peak_by_category[c]), format_bytes(self.current_by_category[c]))
                for c in CATEGORIES]
        rows.append(("total", format_bytes(self.peak_bytes), format_bytes(self.current_bytes)))
        text = format_table(rows, ("category", "at peak", "now"))
        groups = ", ".join(self.peak_unsharded_groups) or "none"
        text += f"\npeak during {self.peak_phase}; unsharded groups at the peak: {groups}"
        if self.device_peak_bytes is not None:
            text += f"\nCUDA allocator peak: {format_bytes(self.device_peak_bytes)}"
        return text

    __str__ = table


class MemoryTracker:
    """Context manager counting this rank's live tensor memory by category.

    Storages that exist when the context is entered (parameters, optimizer state) are
    registered from ``model`` and ``optimizer``; everything an op creates inside the context
    is registered as it is born. Categories are decided by identity at each new peak:
    fsdp2's sharded parameters (``padded_local``), unsharded buffers, gradients (sharded,
    unsharded, accumulated), optimizer state, in-flight collective buffers; other storages
    born while the model's forward or a backward runs are activations; the rest "other".

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
        self._forward_depth = 0
        self._handles: list = []
        self._peak: tuple[dict[str, int], str, list[str]] = ({c: 0 for c in CATEGORIES}, "outside", [])
        self.report: MemoryReport | None = None

    # ---- what fsdp2 and the optimizer hold -----------------------------------------------
    def _groups(self) -> list:
        groups = []
        for module in self.model.modules():
            state = get_state(module)
            if state is not None and state.group is not None and state.group not in groups:
                groups.append(state.group)
        return groups

    def _resizable(self) -> list[torch.UntypedStorage]:
        return [g._buffer.untyped_storage() for g in self._groups() if g._buffer is not None]

    def _roles(self) -> dict[int, str]:
        """Storage key -> category for everything the model, fsdp2 and optimizer hold now."""
        roles: dict[int, str] = {}

        def mark(t: torch.Tensor | None, role: str) -> None:
            if isinstance(t, torch.Tensor):
                for plain in plain_tensors(t):
                    key = storage_key(plain)
                    if key is not None:
                        roles.setdefault(key, role)

        queues = []
        managed: set[int] = set()
        for g in self._groups():
            if g._buffer is not None:
                mark(g._buffer, "unsharded_params")
            if g._gather is not None:
                mark(g._gather.send, "communication")
                mark(g._gather.output, "communication")
            mark(g._partial_send, "communication")
            for t in g._partial_reduce.values():
                mark(t, "communication")
            if g.reduce_queue not in queues:
                queues.append(g.reduce_queue)
            for p in g.params:
                managed.update((id(p.sharded), id(p.unsharded)))
                mark(p.padded_local, "sharded_params")
                mark(p.sharded.grad, "gradients")
                mark(p.accumulated_grad, "gradients")
                if p.unsharded is not None:
                    mark(p.unsharded.grad, "gradients")
        for queue in queues:
            for inflight in queue._pending:
                mark(inflight.input, "communication")
                mark(inflight.output, "communication")
        for p in self.model.parameters():
            if id(p) not in managed:  # not sharded by fsdp2: a full copy on every rank
                mark(p, "unsharded_params")
                mark(p.grad, "gradients")
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for t in state.values():
                    mark(t, "optimizer_state")
        return roles

    def _by_category(self) -> dict[str, int]:
        roles = self._roles()
        out = {c: 0 for c in CATEGORIES}
        for key, nbytes in self._live.sizes.items():
            role = roles.get(key)
            if role is None:
                role = "activations" if key in self._live.tagged else "other"
            out[role] += nbytes
        return out

    def _snapshot_peak(self) -> None:
        phase = "forward" if self._forward_depth else "backward" if in_backward() else "outside"
        live = [g.label for g in self._groups() if g.state in (ShardState.UNSHARDED, ShardState.GATHERING)]
        self._peak = (self._by_category(), phase, live)

    # ---- context ----------------------------------------------------------------------
    def _register_existing(self) -> None:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        for g in self._groups():
            tensors += [p.padded_local for p in g.params]
            tensors += [g._buffer] if g._buffer is not None else []
        if self.optimizer is not None:
            tensors += [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        for t in tensors:
            self._live.add(t)

    def _pre_forward(self, *_args) -> None:
        self._forward_depth += 1

    def _post_forward(self, *_args) -> None:
        self._forward_depth -= 1

    def __enter__(self) -> MemoryTracker:
        self._register_existing()
        self._handles = [
            self.model.register_forward_pre_hook(self._pre_forward, prepend=True),
            self.model.register_forward_hook(self._post_forward, always_call=True),
        ]
        self._live.tag = lambda: bool(self._forward_depth) or in_backward()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._live.__enter__()
        self._live.check_peak()
        return self

    def __exit__(self, *exc) -> None:
        self._live.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._live.refresh(self._resizable())
        peak_cats, phase, groups = self._peak
        device_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        self.report = MemoryReport(
            peak_bytes=self._live.peak, peak_by_category=peak_cats,
            current_bytes=self._live.total, current_by_category=self._by_category(),
            peak_phase=phase, peak_unsharded_groups=groups, device_peak_bytes=device_peak,
        )
