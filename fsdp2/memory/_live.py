"""Live tensor storages, counted once each: a dispatch mode sees them born, finalizers see them die.

Every op's outputs (and any input not seen before) are registered by their storage, keyed
by the storage's C++ identity, so views never count twice. A ``weakref.finalize`` on the
storage removes it when its last user lets go. Storages that are resized in place (fsdp2's
unsharded buffers are resized to 0 bytes on reshard and back on unshard, which no dispatch
mode sees) are re-read whenever the total is asked for.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["aliases", "storage_key", "plain_tensors", "LiveStorages"]

_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
# A functional collective's result wrapped to be waited on later (torch 2.10 and after): on a
# real device the wrapper holds the result's own storage; on the meta device (the memory
# planner) its meta kernel makes a new one (``_carry_over``).
_WRAP = getattr(getattr(torch.ops._c10d_functional, "_wrap_tensor_autograd", None), "default", None)
_CARRIED = tuple(op for op in (_WAIT_TENSOR, _WRAP) if op is not None)


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data (a DTensor's local tensor, recursively)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = (getattr(t, name) for name in names)
    return [plain for x in inner if isinstance(x, torch.Tensor) for plain in plain_tensors(x)]


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of ``t``'s storage (shared by all its views), or None if it has none."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers
        return None


def aliases(tensors: Iterable[object]) -> list[torch.Tensor]:
    """The plain tensors among ``tensors`` whose storage lies within another one's bytes: a storage
    over memory another storage holds (fsdp2's shards, DLPack aliases of their group's packed
    buffer), which must count no bytes of its own."""
    spans: dict[int, tuple[str, int, int, torch.Tensor]] = {}
    for t in tensors:
        for plain in plain_tensors(t) if isinstance(t, torch.Tensor) else ():
            key = storage_key(plain)
            if key is None or plain.device.type == "meta" or key in spans:
                continue
            storage = plain.untyped_storage()
            if storage.nbytes():
                spans[key] = (str(plain.device), storage.data_ptr(), -storage.nbytes(), plain)
    out, reach = [], {}
    # Per device, by start address, the widest first: a storage ending where an earlier one
    # still reaches lies within it.
    for device, start, neg_size, plain in sorted(spans.values(), key=lambda s: s[:3]):
        end = start - neg_size
        if end <= reach.get(device, -1):
            out.append(plain)
        reach[device] = max(reach.get(device, -1), end)
    return out


class LiveStorages(TorchDispatchMode):
    """Bytes of the storages alive now and at the peak, updated op by op.

    Args:
        on_peak: called with no arguments each time the total reaches a new peak, after the
            op that did it (callers snapshot their own categories there).
        resizable: returns the storages whose size may change in place; re-read on every op.
    """

    def __init__(self, on_peak: Callable[[], None] | None = None,
                 resizable: Callable[[], Iterable[torch.UntypedStorage]] | None = None) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # storage key -> bytes when last read
        self.refs: dict[int, weakref.ref] = {}
        self.total = 0
        self.peak = 0
        # Bytes not held by any storage this mode sees (the planner's simulated fsdp2 buffers).
        self.offset = 0
        self._on_peak = on_peak
        self._resizable = resizable
        self.count_meta = True
        # A category for storages at birth (the tracker's "activations" inside an iteration),
        # or set later by callers; forgotten when the storage dies (its key may be reused).
        # ``tag(first_seen_as_input)``: True when an op took the storage as an input before
        # any op this mode saw made it (a buffer a collective allocated out of sight).
        self.tag: Callable[[bool], str | None] | None = None
        self.labels: dict[int, str] = {}

    def add(self, t: torch.Tensor, as_input: bool = False) -> int | None:
        """Register the storages behind ``t`` if new; returns the last key (None: no storage)."""
        key = None
        for plain in plain_tensors(t):
            key = storage_key(plain)
            if key is None or key in self.sizes or plain.device.type == "meta" and not self.count_meta:
                continue
            storage = plain.untyped_storage()
            nbytes = storage.nbytes()
            self.sizes[key] = nbytes
            self.refs[key] = weakref.ref(storage)
            self.total += nbytes
            label = self.tag(as_input) if self.tag is not None else None
            if label is not None:
                self.labels[key] = label
            weakref.finalize(storage, self._free, key)
        return key

    def add_alias(self, t: torch.Tensor) -> None:
        """Register ``t``'s storages as holding no bytes of their own: storages over memory another
        storage holds (fsdp2's packed shards: DLPack aliases of the group's packed buffer)."""
        for plain in plain_tensors(t):
            key = storage_key(plain)
            if key is not None and key not in self.sizes:
                self.sizes[key] = 0
                storage = plain.untyped_storage()
                self.refs[key] = weakref.ref(storage)
                weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        nbytes = self.sizes.pop(key, None)
        self.refs.pop(key, None)
        self.labels.pop(key, None)
        if nbytes is not None:
            self.total -= nbytes

    def refresh(self, storages: Iterable[torch.UntypedStorage]) -> None:
        for storage in storages:
            key = storage._cdata
            if key in self.sizes:
                nbytes = storage.nbytes()
                self.total += nbytes - self.sizes[key]
                self.sizes[key] = nbytes

    def check_peak(self) -> None:
        if self._resizable is not None:
            self.refresh(self._resizable())
        if self.total + self.offset > self.peak:
            self.peak = self.total + self.offset
            if self._on_peak is not None:
                self._on_peak()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self.add(t, as_input=True)
        if func in _CARRIED:
            self._carry_over(args[0], out)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t)
        self.check_peak()
        return out

    def _carry_over(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """``after`` is ``before`` (a collective's result, waited on) under another storage.

        A real ``wait_tensor`` returns its input, a real wrapper of one in flight holds it; on the
        meta device (the planner) either result is a new storage. Count it once: the input's
        bytes and label move to the result.
        """
        old, new = storage_key(before), storage_key(after)
        if old is None or new is None or old == new or old not in self.sizes:
            return
        label = self.labels.get(old)
        self._free(old)
        self.add(after)
        if label is not None:
            self.labels[new] = label
