"""Recipe checkpoints: save every N steps, resume from the newest complete one automatically.

Layout under ``--checkpoint-dir``::

    step-00000100/             a complete checkpoint (DCP: one file per rank, .metadata,
    step-00000200/             and fsdp2_complete.json, written last)
    step-00000300.tmp-<id>/    being written (or left by a crash): never loaded

Each checkpoint is one :func:`fsdp2.checkpoint.save`: every rank writes its own shards into
a temporary directory, and only once all have finished does rank 0 add the completion
marker and rename it into place, so a crash at any moment leaves the previous checkpoints
intact. It holds the model and optimizer (sharded DTensors, so it loads at another world
size or layout too) and, as ``extra``, the LR scheduler and the step. The data position is
the step: batches are a function of it (see ``data.get_batch``).
"""

from __future__ import annotations

import importlib.util
import logging
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2.checkpoint as ckpt

__all__ = ["Checkpointer", "check_export", "export_model"]

logger = logging.getLogger(__name__)
_COMPLETE = re.compile(r"^step-(\d+)$")
_MARKER = "fsdp2_complete.json"  # written last by fsdp2.checkpoint.save (docs/checkpointing.md)


class Checkpointer:
    """Saves and finds checkpoints in one directory; every method is collective.

    Args:
        root: the checkpoint directory (created on first save).
        keep: how many newest checkpoints to keep; 0 keeps all.
    """

    def __init__(self, root: str | Path, *, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def latest(self) -> tuple[int, Path] | None:
        """(step, path) of the newest complete checkpoint, as rank 0 sees it, or None."""
        found: list[tuple[int, Path] | None] = [None]
        if dist.get_rank() == 0:
            steps = self._complete_steps()
            found[0] = (steps[-1], self._dir(steps[-1])) if steps else None
        dist.broadcast_object_list(found, src=0)  # every rank must resume from the same step
        return found[0]

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler) -> Path:
        final = self._dir(step)
        if dist.get_rank() == 0:  # before save's first collective, so before any rank writes
            final.parent.mkdir(parents=True, exist_ok=True)
        # Atomic: the directory appears, complete, only after every rank has written its shards.
        ckpt.save(final, model, optimizer, extra={"step": step, "scheduler": scheduler.state_dict()})
        if dist.get_rank() == 0:
            self._prune()
        return final

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler) -> int:
        """Restore model, optimizer and scheduler from ``path``; returns the step it was saved at."""
        extra = ckpt.load(path, model, optimizer)
        scheduler.load_state_dict(extra["scheduler"])
        return extra["step"]

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
                shutil.rmtree(self._dir(step), ignore_errors=True)


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
