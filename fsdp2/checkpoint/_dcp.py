"""``save`` / ``load``: model, optimizer and extra state through torch.distributed.checkpoint, atomically.

A save writes a DCP checkpoint into ``<path>.tmp-<id>``; once every rank has
finished (DCP's own final gather, then a barrier) rank 0 writes the completion
marker into it and renames it to ``path``, moving a previous checkpoint aside
first and deleting it last. A save interrupted at any point leaves either the
previous complete checkpoint at ``path`` or, in the instant between the two
renames, at ``<path>.old-<id>``, which :func:`load` falls back to. A directory
without the marker is never loaded.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)

__all__ = ["MARKER", "save", "load", "find_complete", "single_process_ok"]

logger = logging.getLogger(__name__)

MARKER = "fsdp2_complete.json"
"""Written last, by rank 0, into a checkpoint directory every rank finished writing."""


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: dict[str, Any] | None = None) -> None:
    """Save ``model`` (and ``optimizer``, and ``extra``) as a sharded DCP checkpoint at ``path``.

    Every rank writes only its own shards (no gather); ``extra`` (step counters,
    RNG states: anything ``torch.load(weights_only=True)`` reads back) is
    written once. Call it on every rank with the same ``path``; the directory
    must be on a filesystem every rank sees. Replaces a previous checkpoint at
    ``path`` only once the new one is complete.

    Args:
        path: the checkpoint directory.
        model: the (sharded or plain) model.
        optimizer: its optimizer, or ``None`` to save the model only.
        extra: small picklable state returned by :func:`load`.
    """
    path = Path(path)
    if path.exists() and not (path / MARKER).is_file():
        raise FileExistsError(f"fsdp2.checkpoint.save: {path} exists and is not an fsdp2 checkpoint; "
                              "refusing to replace it (pick another path or remove it)")
    distributed = dist.is_available() and dist.is_initialized()
    token = [uuid.uuid4().hex[:12]]
    if distributed:
        dist.broadcast_object_list(token, src=0)  # every rank writes into the same directory
    tmp = path.with_name(f"{path.name}.tmp-{token[0]}")
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    if extra is not None:
        buffer = io.BytesIO()
        torch.save(extra, buffer)
        state["extra"] = buffer  # one opaque blob: DCP would flatten a dict into keys
    with single_process_ok():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not distributed)
    if distributed:
        dist.barrier()  # every rank's files are closed before the marker says so
    if not distributed or dist.get_rank() == 0:
        marker = {"format": "fsdp2.checkpoint", "version": 1, "optimizer": optimizer is not None,
                  "extra": extra is not None, "world_size": dist.get_world_size() if distributed else 1}
        _write_synced(tmp / MARKER, json.dumps(marker).encode())
        old = path.with_name(f"{path.name}.old-{token[0]}")
        if path.exists():
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(path.parent)
        # The replaced checkpoint, and leftovers of saves interrupted earlier.
        for stale in [old, *path.parent.glob(f"{path.name}.tmp-*"), *path.parent.glob(f"{path.name}.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)
    if distributed:
        dist.barrier()  # nobody returns (and maybe loads) before the rename


def load(path: str | os.PathLike, model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any] | None:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``); return ``extra``.

    Works on any number of ranks and any sharding (DCP reads the slices each
    rank needs), including a plain model in a single process.

    Raises:
        FileNotFoundError: no complete checkpoint at ``path`` (a directory
            without the completion marker is an interrupted save).
        ValueError: an optimizer was given but the checkpoint has none.
    """
    path = find_complete(path)
    marker = json.loads((path / MARKER).read_text())
    if optimizer is not None and not marker["optimizer"]:
        raise ValueError(f"checkpoint {path} was saved without an optimizer; call load(path, model)")
    distributed = dist.is_available() and dist.is_initialized()
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    if marker["extra"]:
        state["extra"] = io.BytesIO()
    with single_process_ok():
        dcp.load(state, checkpoint_id=str(path), no_dist=not distributed)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    if not marker["extra"]:
        return None
    state["extra"].seek(0)
    return torch.load(state["extra"], weights_only=True)


def find_complete(path: str | os.PathLike) -> Path:
    """``path`` if it holds a complete checkpoint, else the one a save was replacing."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    for old in sorted(path.parent.glob(f"{path.name}.old-*")):
        if (old / MARKER).is_file():
            logger.warning("fsdp2.checkpoint: %s is incomplete or missing; loading %s, the checkpoint an "
                           "interrupted save was replacing", path, old)
            return old
    why = "has no completion marker (an interrupted or foreign save)" if path.exists() else "does not exist"
    raise FileNotFoundError(f"no complete fsdp2 checkpoint at {path}: the directory {why}")


@contextmanager
def single_process_ok() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: here that is on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
