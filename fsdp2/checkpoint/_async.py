"""``AsyncSaver``: checkpoints written in the background while training goes on, as sound as ``save``'s.

A save in ``"async"`` or ``"pinned"`` mode blocks the caller only while it copies the state
dict into host staging buffers (DCP's ``DefaultStager``, created once per saver: the buffers
are kept and copied into again on the next save, so host memory stays flat however many
saves a run makes). DCP's ``async_save`` then writes those buffers from a background thread,
over a gloo process group of the saver's own (created once, on the first save), never over
the training's groups. When this rank's files are written, a second background thread of the
saver runs the end of :func:`fsdp2.checkpoint.save` over that same group: the ranks' CRC-32
sums are gathered (which is also the barrier: every rank's files are complete), then rank 0
writes the completion marker and renames the directory into place. A process killed at any
point before that leaves a ``.tmp-<id>`` directory without a marker, never loaded, and the
previous checkpoint as the newest sound one.

At most one save is in flight: a save (and :meth:`AsyncSaver.wait`, and :meth:`close`) first
waits for the previous one and reports how long in the handle it returns. ``"off"`` is
:func:`fsdp2.checkpoint.save` itself, unchanged. ``"pinned"`` pins the staging buffers where
CUDA is available (faster device-to-host copies); elsewhere it says so once in the log and
behaves like ``"async"``.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from .. import _compat
from ._checksum import ChecksummingFileSystem
from ._dcp import finalize, prepare, save, single_process_ok, state_of

__all__ = ["ASYNC_MODES", "AsyncSaver", "SaveHandle", "check_async_mode"]

logger = logging.getLogger(__name__)

ASYNC_MODES = ("off", "async", "pinned")
"""``off``: synchronous :func:`~fsdp2.checkpoint.save`; ``async``: staged in host memory, written in
the background; ``pinned``: the same with pinned staging buffers where CUDA is available."""


def check_async_mode(mode: object, where: str = "async_mode") -> str:
    """``mode`` if it is one of :data:`ASYNC_MODES`, else a ValueError naming them."""
    if mode not in ASYNC_MODES:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, ASYNC_MODES))}, got {mode!r}")
    return mode  # type: ignore[return-value]


@dataclass
class SaveHandle:
    """One save started by :meth:`AsyncSaver.save`.

    ``blocked_s``: how long ``save`` kept the caller (waiting for the previous save, then
    staging); ``waited_s``: the part of it spent waiting for the previous save. ``written_s``
    (set once done): from the start of ``save`` until the checkpoint was complete on disk.
    """

    path: Path
    blocked_s: float
    waited_s: float
    written_s: float | None = None
    _future: Future | None = field(default=None, repr=False)

    def done(self) -> bool:
        """Whether the save has finished (successfully or not); never blocks."""
        return self._future is None or self._future.done()

    def wait(self) -> None:
        """Block until the checkpoint is complete on disk; re-raise what failed in the background."""
        if self._future is not None:
            self.written_s = self._future.result()
            self._future = None


class AsyncSaver:
    """Saves checkpoints like :func:`fsdp2.checkpoint.save`, writing them while the caller goes on.

    Create one per run, on every rank, and keep it: it owns the staging buffers and the gloo
    group the background writes use (both made on the first save). Every method is collective.
    Call :meth:`close` (or use it as a context manager) at the end: it waits for the last save.

    Args:
        async_mode: ``"async"``, ``"pinned"`` or ``"off"`` (see :data:`ASYNC_MODES`).
    """

    def __init__(self, async_mode: str = "async") -> None:
        self.async_mode = check_async_mode(async_mode)
        self._pinned = async_mode == "pinned" and torch.cuda.is_available()
        if async_mode == "pinned" and not self._pinned:
            logger.info("fsdp2.checkpoint: async_mode='pinned' pins staging buffers only where CUDA is available; "
                        "staging in ordinary host memory (as async_mode='async')")
        self._stager: Any = None
        self._group: dist.ProcessGroup | None = None
        self._finisher: ThreadPoolExecutor | None = None
        self._pending: SaveHandle | None = None

    def save(self, path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             extra: dict[str, Any] | None = None, *, flat_optimizer: bool = False) -> SaveHandle:
        """Start saving a checkpoint to ``path`` (arguments as :func:`fsdp2.checkpoint.save`); returns its handle.

        Waits for the previous save first. Returns once the state is staged (``"off"``: once it
        is saved); ``model`` and ``optimizer`` may change right away. Errors of the background
        write surface at the handle's (or this saver's) next ``wait``.
        """
        start = time.perf_counter()
        previous = self.wait()
        waited = time.perf_counter() - start
        if previous is not None and waited > 0.001:
            logger.info("fsdp2.checkpoint: waited %.2f s for the save of %s before saving %s", waited, previous.path,
                        path)
        path = Path(path)
        if self.async_mode == "off":
            save(path, model, optimizer, extra, flat_optimizer=flat_optimizer)
            blocked = time.perf_counter() - start
            return SaveHandle(path, blocked_s=blocked, waited_s=waited, written_s=blocked)
        distributed = dist.is_available() and dist.is_initialized()
        tmp, token = prepare(path)
        state = state_of(model, optimizer, extra, flat_optimizer)
        writer = dcp.FileSystemWriter(str(tmp))
        summing = _compat.wrap_dcp_writer_files(writer, lambda fs: ChecksummingFileSystem(fs, tmp))
        group = self._checkpoint_group() if distributed else None
        with single_process_ok():
            started = dcp.async_save(state, storage_writer=writer, process_group=group, async_stager=self._staging(),
                                     no_dist=not distributed)
        upload = getattr(started, "upload_completion", started)  # an AsyncSaveResponse where staging is async
        saved = {"optimizer": optimizer is not None, "flat_optimizer": flat_optimizer, "extra": extra is not None}
        future = self._background().submit(self._finish, upload, path, tmp, token, summing, saved, group, start)
        self._pending = SaveHandle(path, blocked_s=time.perf_counter() - start, waited_s=waited, _future=future)
        return self._pending

    @staticmethod
    def _finish(upload: Future, path: Path, tmp: Path, token: str, summing: ChecksummingFileSystem | None,
                saved: dict[str, bool], group: dist.ProcessGroup | None, start: float) -> float:
        """Background: once this rank's files are written, the marker and the rename (over ``group`` only)."""
        upload.result()
        finalize(path, tmp, token, summing.sums if summing is not None else {}, saved, pg=group)
        return time.perf_counter() - start

    def wait(self) -> SaveHandle | None:
        """Block until the save in flight (if any) is complete on disk; return its handle (None: none was)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
        return pending

    def close(self) -> SaveHandle | None:
        """Wait for the last save, then free the staging buffers and the background thread."""
        try:
            return self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._finisher is not None:
                self._finisher.shutdown(wait=True)
                self._finisher = None

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _staging(self) -> Any:
        # One stager for the saver's life: its host buffers are copied into again at every save.
        # Before torch 2.13 a stager serves one save only (_compat.DCP_STAGER_REUSABLE): a new one
        # each time, its buffers freed once the save is written.
        if self._stager is None or not _compat.DCP_STAGER_REUSABLE:
            self._stager = _compat.dcp_stager(pinned=self._pinned)
        return self._stager

    def _checkpoint_group(self) -> dist.ProcessGroup:
        # Collective, on the main thread, at the first save (every rank saves at the same point).
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _background(self) -> ThreadPoolExecutor:
        if self._finisher is None:
            self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp2-checkpoint")
        return self._finisher
