"""Recipe checkpoints: save every N steps, resume from the newest sound one, never lose work.

Layout under ``--checkpoint-dir`` (the directory belongs to the run: it names what it finds
there by these patterns)::

    step-00000100/                   a checkpoint (DCP: one file per rank, .metadata, and
    step-00000200/                   fsdp2_complete.json, written last)
    step-00000300.tmp-<id>/          being written (or left by a crash): never loaded
    step-00000000.del-<id>/          being pruned (or left by a crash): never loaded
    step-00000400.unusable-<id>/     failed verification or loading; moved aside, kept for inspection

Each checkpoint is one :func:`fsdp2.checkpoint.save`: every rank writes its own shards into
a temporary directory, and only once all have finished does rank 0 add the completion
marker (which lists every file with its size and the CRC-32 the save took of its bytes as it
wrote them) and rename it into place, so a crash at any moment leaves the previous
checkpoints intact. It holds the model and optimizer (sharded DTensors, so it loads at
another world size or layout too) and, as ``extra``, the LR scheduler, the step and the
skipped-step counters. The data position is the step: batches are a function of it (see
``data.get_batch``).

Only sound checkpoints count. Before the model is allocated, :meth:`Checkpointer.choose`
checks the checkpoints newest first with :func:`fsdp2.checkpoint.verify_on_ranks` (marker
present and readable, every file it lists there with its size and checksum, ``.metadata``
readable and pointing inside the files; each rank reads its share of the files) and takes
the newest sound one. Unusable ones newer than it are moved aside (renamed
``.unusable-<id>``, never deleted) with one line naming what is wrong, so no later start, a
torchrun restart included, meets them again. A checkpoint that passes the checks but fails
to load (a DCP or unpickling error, missing keys) is moved aside the same way and the next
sound one is loaded. A directory that holds or held checkpoints (moved-aside ones count) but
no sound one stops the run in one line (:class:`UnusableCheckpointError`), before anything
is allocated, rather than silently starting over, unless the run is told to start fresh.
Pruning keeps the newest ``keep`` *sound* checkpoints (sizes and ``.metadata``; the
checksums are checked on resume): an unusable one never counts toward them, so it can never
cost a sound one its place, and the checkpoint just saved is always kept. A pruned
checkpoint is renamed out of the ``step-N`` namespace before it is deleted, so a crash
mid-delete never leaves a half-deleted checkpoint that looks complete; leftovers of
interrupted saves and prunes are removed when the next run starts.

With ``async_mode`` ``"async"`` or ``"pinned"`` the saves go through
:class:`fsdp2.checkpoint.AsyncSaver`: :meth:`Checkpointer.save` returns once the state is
staged in host memory, the ranks write in the background, and the marker comes only once all
have finished, so the guarantees above hold unchanged. The next save (or :meth:`~Checkpointer.wait`,
:meth:`~Checkpointer.close`) waits for it, then records and prunes it.

Every save (with what it pruned), resume, fresh start and moved-aside checkpoint is one log
record of the ``recipes.checkpoint`` logger, on rank 0 (``train.py`` prints them).
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2.checkpoint as ckpt
from fsdp2._wire import all_gather_json, broadcast_json

__all__ = ["Checkpointer", "UnusableCheckpointError", "check_checkpoint_dir", "check_export", "export_model",
           "check_initial_load", "load_initial"]

logger = logging.getLogger(__name__)
_STEP = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^(step-\d+)\.(tmp|old|del)-\w+$")  # see the layout above and fsdp2.checkpoint.save
_MARKER = "fsdp2_complete.json"  # written last by fsdp2.checkpoint.save (docs/checkpointing.md)
FRESH_FLAG = "--checkpoint.start_fresh_if_unusable"


class UnusableCheckpointError(RuntimeError):
    """The checkpoint directory holds checkpoints, none of them sound: resuming would lose work."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _from_rank0(value: Any) -> Any:
    """``value`` (JSON-serialisable) as rank 0 has it, on every rank (itself without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    return broadcast_json(value)


def _one_line(error: BaseException) -> str:
    """An exception as one short line: DCP's own names each rank's exception with its traceback."""
    import torch.distributed.checkpoint as dcp  # loaded already: only a failed load or save gets here

    if isinstance(error, dcp.CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    text = " ".join(str(error).split()) or "no message"
    return f"{type(error).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


class Checkpointer:
    """Saves and finds checkpoints in one directory; every public method is collective.

    Works without a process group too (one process is rank 0).

    Args:
        root: the checkpoint directory (created on first save).
        keep: how many newest sound checkpoints to keep; 0 keeps all.
        start_fresh_if_unusable: when ``root`` holds checkpoints but none is sound, start
            from step 0 (moving them aside) instead of raising :class:`UnusableCheckpointError`.
        flat_optimizer: save the optimizer state by parameter name (pipeline stages: each rank's
            parameter groups name different parameters; ``fsdp2.checkpoint.save``). Loading reads either.
        async_mode: ``"off"`` (each save complete before :meth:`save` returns), ``"async"`` or
            ``"pinned"`` (written in the background by :class:`fsdp2.checkpoint.AsyncSaver`; the
            next save, :meth:`wait` and :meth:`close` wait for it, then prune and log it).
    """

    def __init__(self, root: str | Path, *, keep: int = 2, start_fresh_if_unusable: bool = False,
                 flat_optimizer: bool = False, async_mode: str = "off") -> None:
        self.root = Path(root)
        self._saver = ckpt.AsyncSaver(async_mode)
        if async_mode == "pinned" and not torch.cuda.is_available() and _rank() == 0:
            logger.info("checkpoint: async_mode=pinned pins staging buffers only where CUDA is available; staging "
                        "in ordinary host memory (as async_mode=async)")
        self._pending: tuple[int, ckpt.SaveHandle] | None = None  # an async save in flight
        self.flat_optimizer = flat_optimizer
        self.keep = keep
        self.start_fresh_if_unusable = start_fresh_if_unusable
        self.last_step: int | None = None  # the newest checkpoint this run resumed from or saved
        self._choice: dict[str, Any] | None = None  # what choose() decided (every rank holds rank 0's)
        self._load_failed = False  # a checkpoint that passed the checks failed to load: the model is dirty

    # ---- finding ----------------------------------------------------------------------------
    def latest(self) -> tuple[int, Path] | None:
        """(step, path) of the newest sound checkpoint, as rank 0 sees it, or None.

        Rank 0 first removes what interrupted saves and prunes left behind, then checks the
        checkpoints newest first with :func:`fsdp2.checkpoint.verify` (content included),
        warning about each one that fails (it is left in place: see :meth:`choose` for what a
        run does with it). Every rank gets rank 0's answer: all must resume from the same step.
        """
        found = None
        if _rank() == 0:
            self._clean_leftovers()
            for step in reversed(self._steps()):
                if not (problems := ckpt.verify(self._dir(step))):
                    found = [step, str(self._dir(step))]
                    break
                logger.warning("checkpoint: skipping %s, unusable: %s", self._dir(step), "; ".join(problems))
        found = _from_rank0(found)
        return (found[0], Path(found[1])) if found else None

    def choose(self) -> int | None:
        """Collective, before the model is allocated: the step to resume from, or None for step 0.

        Rank 0 removes what interrupted saves and prunes left behind; then the ranks check the
        checkpoints newest first with :func:`fsdp2.checkpoint.verify_on_ranks` (sizes,
        ``.metadata``, every file's checksum: each rank reads its share) until one is sound.
        Unusable ones newer than it are moved aside, one warning line each, so no later start
        (a torchrun restart included) meets them again. Raises :class:`UnusableCheckpointError`
        on every rank when the directory holds checkpoints, or held them (moved-aside ones
        count), but none is sound, unless ``start_fresh_if_unusable``. The answer is kept for
        :meth:`resume`.
        """
        if self._choice is not None:
            return self._choice["step"]
        seen = None
        if _rank() == 0:
            existed, leftovers = self.root.is_dir(), self._clean_leftovers()
            seen = {"existed": existed, "leftovers": leftovers, "steps": self._steps()}
        seen = _from_rank0(seen)
        found, unusable = None, []
        for step in reversed(seen["steps"]):  # every rank takes part in each check
            if not (problems := ckpt.verify_on_ranks(self._dir(step))):
                found = step
                break
            unusable.append((self._dir(step).name, problems))
        decision = _from_rank0(self._decide(found, unusable, seen["existed"], seen["leftovers"])
                               if _rank() == 0 else None)
        if decision["error"]:
            raise UnusableCheckpointError(decision["error"])
        self._choice = decision
        return decision["step"]

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any] | None:
        """Load the checkpoint :meth:`choose` picks and return its extra state, or None to start from step 0.

        Collective. A checkpoint that passed the checks but still fails to load (a DCP or
        unpickling error, missing keys: every rank's outcome is gathered, so all agree) is
        moved aside with one warning line, and the next sound one is tried. Logs one line:
        resumed from which step, or why the run starts fresh. Raises
        :class:`UnusableCheckpointError` on every rank when no sound checkpoint is left.
        """
        while (step := self.choose()) is not None:
            path = self._dir(step)
            extra, failure = self._try_load(path, model, optimizer, scheduler)
            if failure is None:
                self.last_step = extra["step"]
                if _rank() == 0:
                    logger.info("checkpoint: resumed from %s at step %d", path, extra["step"])
                return extra
            self._choice, self._load_failed = None, True
            if _rank() == 0:
                aside = self._move_aside(path.name)
                logger.warning("checkpoint: %s could not be loaded (%s); moved it to %s (kept for inspection, never "
                               "loaded again)", path, failure, aside.name)
        return None

    def _try_load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: torch.optim.lr_scheduler.LRScheduler) -> tuple[dict[str, Any] | None, str | None]:
        """Collective: (extra state, None), or (None, what went wrong on the first rank it went wrong on)."""
        import torch.distributed.checkpoint as dcp  # (loading imports it anyway; a run without checkpoints never)

        extra, failure = None, None
        try:
            extra = self.load(path, model, optimizer, scheduler, check_content=False)  # choose() just did
        except (Exception, dcp.CheckpointException) as e:  # whatever makes it unloadable; not Ctrl-C
            failure = _one_line(e)
        if dist.is_available() and dist.is_initialized():
            failure = next((f for f in all_gather_json(failure) if f is not None), None)
        return (extra, None) if failure is None else (None, failure)

    def _decide(self, found: int | None, unusable: list[tuple[str, list[str]]], existed: bool,
                leftovers: int) -> dict[str, Any]:
        """Rank 0: which step to resume from (None: fresh), or the error that stops the run."""
        aside = sorted(p.name for p in self.root.iterdir() if ".unusable-" in p.name) if existed else []
        if found is None and (unusable or aside) and (self._load_failed or not self.start_fresh_if_unusable):
            listed = [f"{name} ({'; '.join(problems)})" for name, problems in unusable]
            listed += [f"{name} (moved aside earlier)" for name in aside]
            # After a failed load the model holds part of a checkpoint: only a new start can begin at step 0.
            if self._load_failed:
                fix = (f"run again with {FRESH_FLAG} to start from step 0 (if the model's configuration changed "
                       "since they were saved, rename them back to their step-N names and run the configuration "
                       "that saved them instead)")
            elif unusable:
                fix = (f"repair them (e.g. copy them again) or move them out of the directory, or pass {FRESH_FLAG} "
                       "to start from step 0 (they are then moved aside, not deleted)")
            else:
                fix = f"rename one back to its step-N name once repaired, or pass {FRESH_FLAG} to start from step 0"
            return {"step": None, "error": (
                f"checkpoint.dir {self.root} holds no usable checkpoint: {'; '.join(listed)}. Starting from step 0 "
                f"would ignore them: {fix}")}
        for name, problems in unusable:
            moved = self._move_aside(name)
            logger.warning("checkpoint: %s is unusable (%s); moved it to %s (kept for inspection, never loaded)",
                           self.root / name, "; ".join(problems), moved.name)
        if found is None:
            logger.info("checkpoint: starting from step 0: %s", self._why_fresh(existed, leftovers, unusable or aside))
        return {"step": found, "error": None}

    def _why_fresh(self, existed: bool, leftovers: int, unusable: list) -> str:
        if unusable:
            return f"no usable checkpoint in {self.root} ({FRESH_FLAG})"
        if not existed:
            return f"{self.root} does not exist yet{self._did_you_mean()}; the first save creates it"
        interrupted = f" (removed {leftovers} interrupted save{'s' * (leftovers != 1)})" if leftovers else ""
        return f"no checkpoint in {self.root}{interrupted}"

    def _did_you_mean(self) -> str:
        """A sibling of a missing ``root`` with a close name that holds checkpoints (a typo?)."""
        parent = self.root.parent
        if not parent.is_dir():
            return f" (nor does {parent})"
        siblings = [p.name for p in parent.iterdir() if p.is_dir() and _step_names(p)]
        close = difflib.get_close_matches(self.root.name, siblings, n=1, cutoff=0.6)
        if not close:
            return ""
        newest = max(int(_STEP.match(n).group(1)) for n in _step_names(parent / close[0]))
        return f" (did you mean {parent / close[0]}? it holds checkpoints up to step {newest})"

    def newest_saved(self) -> int | None:
        """This process's view, no collective: the newest step resumed from, saved, or complete on disk.

        After Ctrl-C: a save renames its checkpoint into place (complete) before ``save``
        returns and records it, so an interrupt in between finds it on disk only. An async save
        in flight is waited for first (every rank's background write goes on under Ctrl-C).
        """
        try:
            self.wait()
        except Exception as e:  # the interrupt is what the caller reports; the save's failure is a line
            logger.warning("checkpoint: the save in flight failed: %s", _one_line(e))
        on_disk = [int(_STEP.match(name).group(1)) for name in _step_names(self.root)
                   if (self.root / name / _MARKER).is_file()]
        steps = on_disk + ([self.last_step] if self.last_step is not None else [])
        return max(steps) if steps else None

    # ---- saving ------------------------------------------------------------------------------
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, *, extra: dict[str, Any] | None = None) -> Path:
        """Save at ``step`` (``extra``: more small state, e.g. counters), then prune to ``keep``.

        Async: first waits for the previous save (and prunes after it), then returns once the
        state is staged; the log line says how long training was blocked and how much of it was
        spent waiting. The checkpoint is complete once :meth:`wait` returns.
        """
        final = self._dir(step)
        start = time.perf_counter()
        previous = self._pending[0] if self._pending else None
        waited = self.wait()
        if _rank() == 0:  # before save's first collective, so before any rank writes
            final.parent.mkdir(parents=True, exist_ok=True)
        # Atomic: the directory appears, complete, only after every rank has written its shards.
        handle = self._saver.save(final, model, optimizer,
                                  extra={**(extra or {}), "step": step, "scheduler": scheduler.state_dict()},
                                  flat_optimizer=self.flat_optimizer)
        if self._saver.async_mode == "off":
            self._saved(step, time.perf_counter() - start, "")
        else:
            self._pending = (step, handle)
            if _rank() == 0:
                of = f", of which {waited:.2f} s waiting for the save of step {previous}" if previous else ""
                logger.info("checkpoint: saving step %d to %s in the background (training blocked %.2f s%s)", step,
                            final, time.perf_counter() - start, of)
        return final

    def wait(self) -> float:
        """Collective: finish the async save in flight, if any (prune, log it); returns the seconds waited."""
        if self._pending is None:
            return 0.0
        (step, handle), self._pending = self._pending, None
        start = time.perf_counter()
        handle.wait()
        waited = time.perf_counter() - start
        self._saved(step, handle.written_s or 0.0, ", in the background")
        return waited

    def close(self) -> None:
        """Collective, at the end of a run: wait for the last async save and free its staging buffers."""
        self.wait()
        self._saver.close()

    def _saved(self, step: int, seconds: float, how: str) -> None:
        """A save of ``step`` is complete on disk: record it; rank 0 prunes and logs it."""
        self.last_step = step
        if _rank() == 0:
            final = self._dir(step)
            pruned = self._prune()
            done = f"; pruned step{'s' * (len(pruned) > 1)} {', '.join(map(str, pruned))}" if pruned else ""
            logger.info("checkpoint: saved step %d to %s (%.1f MiB in %.1f s%s)%s", step, final, _mib(final), seconds,
                        how, done)

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, *, check_content: bool = True) -> dict[str, Any]:
        """Restore model, optimizer and scheduler from ``path``; returns its extra state (``["step"]``...)."""
        extra = ckpt.load(path, model, optimizer, check_content=check_content)
        scheduler.load_state_dict(extra["scheduler"])
        return extra

    def _prune(self) -> list[int]:
        """Rank 0: keep the newest ``keep`` sound checkpoints, move unusable newer ones aside, delete
        the rest; returns the steps deleted."""
        if not self.keep:
            return []
        kept = 0
        pruned: list[int] = []
        for step in reversed(self._steps()):
            if kept == self.keep:
                pruned.append(step)
                self._delete(step)
            elif problems := ckpt.verify(self._dir(step), content=False):  # sums: checked on resume
                aside = self._move_aside(self._dir(step).name)
                logger.warning("checkpoint: %s is unusable (%s); moved it to %s instead of counting it among the "
                               "%d kept", self._dir(step), "; ".join(problems), aside.name, self.keep)
            else:
                kept += 1
        return sorted(pruned)

    def _delete(self, step: int) -> None:
        # Out of the step-N namespace first (atomic), then delete: a crash in the middle of
        # rmtree must not leave a marker over missing shards.
        doomed = self.root / f"{self._dir(step).name}.del-{uuid.uuid4().hex[:12]}"
        os.rename(self._dir(step), doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def _move_aside(self, name: str) -> Path:
        aside = self.root / f"{name}.unusable-{uuid.uuid4().hex[:12]}"
        os.rename(self.root / name, aside)
        return aside

    # ---- the directory -----------------------------------------------------------------------
    def _dir(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def _steps(self) -> list[int]:
        """Every ``step-N`` directory's step, sound or not, ascending."""
        return sorted(int(_STEP.match(name).group(1)) for name in _step_names(self.root))

    def _clean_leftovers(self) -> int:
        """Remove the temporary directories of saves and prunes a crash interrupted (rank 0, no save
        running); returns how many."""
        if not self.root.is_dir():
            return 0
        removed = 0
        for entry in sorted(self.root.iterdir()):
            match = _LEFTOVER.match(entry.name)
            if not match:
                continue
            name, kind = match.groups()
            if kind == "old" and (entry / _MARKER).is_file() and not (self.root / name).exists():
                # Died between moving a checkpoint aside and renaming its replacement in.
                os.rename(entry, self.root / name)
                logger.warning("checkpoint: restored %s from %s, left by an interrupted save", name, entry.name)
            else:
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
                logger.info("checkpoint: removed %s, left by an interrupted save or prune", entry)
        return removed


def _step_names(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return [entry.name for entry in root.iterdir() if _STEP.match(entry.name) and entry.is_dir()]


def _is_safetensors(path: Path) -> bool:
    """A .safetensors file, or a directory of them (``model.safetensors`` or Hugging Face's shard index)."""
    return path.suffix == ".safetensors" or (path.is_dir() and any(
        (path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")))


def check_initial_load(path: str | Path) -> None:
    """Raise ValueError, before any collective, if ``checkpoint.initial_load_path`` could not be loaded."""
    where = f"checkpoint.initial_load_path={path}"
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{where} does not exist")
    if _is_safetensors(path) or ckpt.is_hf_folder(path):  # (a Hugging Face folder's tensors: recipes/hf.py)
        if importlib.util.find_spec("safetensors") is None:
            raise ValueError(f"{where}: reading safetensors needs the 'safetensors' package "
                             "(pip install -e '.[checkpoint]')")
        return
    if path.is_file():
        raise ValueError(f"{where} is a file but not .safetensors; pass a .safetensors file (e.g. one "
                         "--checkpoint.export wrote) or a DCP checkpoint directory")
    _need_numpy(where)
    from fsdp2.checkpoint.__main__ import find_checkpoint  # imports DCP: only for a DCP path

    try:
        find_checkpoint(path)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def load_initial(path: str | Path, model: nn.Module) -> None:
    """Collective: the model's weights from ``path`` (checked by :func:`check_initial_load`), nothing else.

    A Hugging Face folder (``config.json`` and safetensors) goes through :func:`fsdp2.checkpoint.load_hf`
    (names mapped, rotary rows permuted); a .safetensors file (or directory) through
    :func:`fsdp2.checkpoint.load_full`: each rank memory-maps it and reads its own rows. A DCP
    checkpoint, a step directory or a run's checkpoint directory (its newest sound checkpoint),
    through :func:`fsdp2.checkpoint.load` with no optimizer: its model only. Either works at any world size and layout.
    """
    path = Path(path)
    if ckpt.is_hf_folder(path):  # its config.json built the model (recipes/hf.py)
        ckpt.load_hf(path, model)
        source = f"{path} (Hugging Face model)"
    elif _is_safetensors(path):
        ckpt.load_full(path, model)
        source = f"{path} (safetensors)"
    else:
        from fsdp2.checkpoint.__main__ import find_checkpoint  # imports DCP

        found, _skipped = find_checkpoint(path)
        ckpt.load(found, model)
        source = f"{found} (DCP checkpoint)"
    if _rank() == 0:
        logger.info("checkpoint: starting from the weights in %s: the model only, the optimizer and the "
                    "schedule start fresh (checkpoint.initial_load_path)", source)


def check_checkpoint_dir(path: str | Path) -> None:
    """Raise ValueError, before any collective, if checkpoints could not be saved to or loaded from ``path``."""
    if Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"checkpoint.dir={path} is a file, not a directory")
    _need_numpy(f"checkpoint.dir={path}")


def _need_numpy(where: str) -> None:
    # torch.distributed.checkpoint exchanges its save and load plans with torch's object
    # collectives, which need numpy: without it the first save fails after the first steps.
    if importlib.util.find_spec("numpy") is None:
        raise ValueError(
            f"{where}: checkpoints need numpy (torch.distributed.checkpoint's object "
            "collectives use it): pip install -e '.[checkpoint]' (or pip install numpy)"
        )


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
