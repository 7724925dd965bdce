"""Recipe checkpoints: save every N steps, resume from the newest complete one automatically.

Layout under ``--checkpoint-dir``::

    step-00000100/             a complete checkpoint (DCP: one file per rank, .metadata,
    step-00000200/             and fsdp2_complete.json, written last)
    step-00000300.tmp-<id>/    being written (or left by a crash): never loaded
    step-00000000.del-<id>/    being pruned (or left by a crash): never loaded

Each checkpoint is one :func:`fsdp2.checkpoint.save`: every rank writes its own shards into
a temporary directory, and only once all have finished does rank 0 add the completion
marker (which lists every file and its size) and rename it into place, so a crash at any
moment leaves the previous checkpoints intact. It holds the model and optimizer (sharded
DTensors, so it loads at another world size or layout too) and, as ``extra``, the LR
scheduler, the step and the skipped-step counters. The data position is the step: batches
are a function of it (see ``data.get_batch``).

Resuming picks the newest checkpoint that passes :func:`fsdp2.checkpoint.verify`; one that
fails (a file deleted or truncated after the save) is skipped with a warning naming it and
what is wrong, and the next newest is used. Pruning renames a checkpoint out of the
``step-N`` namespace before deleting it, so a crash mid-delete never leaves a half-deleted
checkpoint that looks complete; leftovers of interrupted saves and prunes are removed when
the next run starts.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2.checkpoint as ckpt
from fsdp2._wire import broadcast_json

__all__ = ["Checkpointer", "check_export", "export_model"]

logger = logging.getLogger(__name__)
_COMPLETE = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^(step-\d+)\.(tmp|old|del)-\w+$")  # see the layout above and fsdp2.checkpoint.save
_MARKER = "fsdp2_complete.json"  # written last by fsdp2.checkpoint.save (docs/checkpointing.md)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _from_rank0(value: Any) -> Any:
    """``value`` (JSON-serialisable) as rank 0 has it, on every rank (itself without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    return broadcast_json(value)


class Checkpointer:
    """Saves and finds checkpoints in one directory; every method is collective.

    Works without a process group too (one process is rank 0).

    Args:
        root: the checkpoint directory (created on first save).
        keep: how many newest checkpoints to keep; 0 keeps all.
    """

    def __init__(self, root: str | Path, *, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def latest(self) -> tuple[int, Path] | None:
        """(step, path) of the newest sound checkpoint, as rank 0 sees it, or None.

        Rank 0 first removes what interrupted saves and prunes left behind, then
        checks the checkpoints newest first with :func:`fsdp2.checkpoint.verify`,
        warning about (and passing over) each one that fails. Every rank gets
        rank 0's answer: all must resume from the same step.
        """
        found = None
        if _rank() == 0:
            self._clean_leftovers()
            for step in reversed(self._complete_steps()):
                problems = ckpt.verify(self._dir(step))
                if not problems:
                    found = (step, self._dir(step))
                    break
                logger.warning("skipping corrupted checkpoint %s: %s", self._dir(step), "; ".join(problems))
        found = _from_rank0([found[0], str(found[1])] if found else None)
        return (found[0], Path(found[1])) if found else None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, *, extra: dict[str, Any] | None = None) -> Path:
        """Save at ``step`` (``extra``: more small state, e.g. counters), then prune to ``keep``."""
        final = self._dir(step)
        if _rank() == 0:  # before save's first collective, so before any rank writes
            final.parent.mkdir(parents=True, exist_ok=True)
        # Atomic: the directory appears, complete, only after every rank has written its shards.
        ckpt.save(final, model, optimizer, extra={**(extra or {}), "step": step, "scheduler": scheduler.state_dict()})
        if _rank() == 0:
            self._prune()
        return final

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
        """Restore model, optimizer and scheduler from ``path``; returns its extra state (``["step"]``...)."""
        extra = ckpt.load(path, model, optimizer)
        scheduler.load_state_dict(extra["scheduler"])
        return extra

    def _dir(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def _complete_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        steps = []
        for entry in self.root.iterdir():
            match = _COMPLETE.match(entry.name)
            if match and (entry / _MARKER).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def _prune(self) -> None:
        if self.keep:
            for step in self._complete_steps()[: -self.keep]:
                # Out of the step-N namespace first (atomic), then delete: a crash in the middle
                # of rmtree must not leave a marker over missing shards.
                doomed = self.root / f"{self._dir(step).name}.del-{uuid.uuid4().hex[:12]}"
                os.rename(self._dir(step), doomed)
                shutil.rmtree(doomed, ignore_errors=True)

    def _clean_leftovers(self) -> None:
        """Remove the temporary directories of saves and prunes a crash interrupted (rank 0, no save running)."""
        if not self.root.is_dir():
            return
        for entry in sorted(self.root.iterdir()):
            match = _LEFTOVER.match(entry.name)
            if not match:
                continue
            name, kind = match.groups()
            if kind == "old" and (entry / _MARKER).is_file() and not (self.root / name).exists():
                # Died between moving a checkpoint aside and renaming its replacement in.
                os.rename(entry, self.root / name)
                logger.warning("restored %s from %s, left by an interrupted save", name, entry.name)
            else:
                shutil.rmtree(entry, ignore_errors=True)
                logger.info("removed %s, left by an interrupted save or prune", entry)


def check_export(path: str | Path) -> None:
    """Raise ValueError, before any collective, if the export to ``path`` could not be written."""
    if Path(path).suffix == ".safetensors" and importlib.util.find_spec("safetensors") is None:
        raise ValueError(
            f"checkpoint.export={path}: writing safetensors needs the 'safetensors' package "
            "(pip install -e '.[checkpoint]'), or export to a .pt file (torch.save) instead"
        )


def export_model(model: nn.Module, path: str | Path) -> None:
    """Collective: write the full (unsharded) model to one file on rank 0.

    ``.safetensors`` is streamed, one parameter gathered at a time (rank 0 never holds the
    whole model); any other suffix is a ``torch.save`` of the state dict. Either loads into
    an unsharded ``Transformer`` anywhere, no process group needed.
    """
    path = Path(path)
    if dist.get_rank() == 0:  # the only rank that writes
        path.parent.mkdir(parents=True, exist_ok=True)
    ckpt.export_full(path, model, format="safetensors" if path.suffix == ".safetensors" else "torch")
    logger.info("exported the full model to %s", path)
