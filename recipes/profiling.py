"""Profiler traces and memory snapshots of chosen steps (``--profiling.*``), written by torch's own tools.

- ``profiling.trace_steps``: each listed step runs under ``torch.profiler.profile`` (CPU, and
  CUDA where the run is on GPUs) and each rank writes a Chrome trace,
  ``<dump_folder>/profile_traces/step-N/rank<R>_trace.json``: open it in Perfetto
  (ui.perfetto.dev) or ``chrome://tracing``. fsdp2's collectives appear as ``fsdp2::...``
  ranges (``torch.profiler.record_function``).
- ``profiling.memory_snapshot_steps``: on CUDA, the allocator records its history for the step
  (``torch.cuda.memory._record_memory_history``, torch's documented way though the name is
  private) and each rank dumps it to ``<dump_folder>/memory_snapshot/step-N/rank<R>_memory_snapshot.pickle``,
  for pytorch.org/memory_viz. The CPU allocator keeps no such history, so on CPU the step runs
  under :class:`fsdp2.MemoryTracker` instead and each rank writes its live bytes by category at
  the step's peak (``rank<R>_memory.txt``, and ``.json``); the run says so when it starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn

import fsdp2

from .config import JobConfig

__all__ = ["Profiler"]

logger = logging.getLogger(__name__)

# How many allocator events CUDA keeps for a snapshot (torchtitan's figure): enough for a step
# of a large model, bounded so recording cannot exhaust host memory.
MAX_CUDA_EVENTS = 100_000


class Profiler:
    """Wraps the steps ``config.profiling`` names in a profiler and/or a memory recorder.

    Args:
        config: the job (``profiling.*`` and ``job.dump_folder``).
        rank: this process's global rank (names the files).
        device: the training device: CUDA records the allocator's history, CPU runs fsdp2's tracker.
    """

    def __init__(self, config: JobConfig, rank: int, device: torch.device) -> None:
        self.trace_steps = set(config.profiling.trace_steps)
        self.snapshot_steps = set(config.profiling.memory_snapshot_steps)
        self.root = Path(config.job.dump_folder)
        self.rank, self.device = rank, device
        if self.snapshot_steps and device.type != "cuda" and rank == 0:
            logger.info("profiling: memory snapshots on CPU: torch records allocation history on CUDA only "
                        "(torch.cuda.memory._record_memory_history); writing fsdp2.MemoryTracker's live bytes by "
                        "category at each chosen step's peak instead")

    @contextlib.contextmanager
    def step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Run one training step (the ``with`` body) under whatever ``step`` asks for."""
        with contextlib.ExitStack() as stack:
            if step in self.snapshot_steps:
                stack.enter_context(self._memory_snapshot(step, model, optimizer))
            if step in self.trace_steps:
                stack.enter_context(self._trace(step))
            yield

    def _folder(self, kind: str, step: int) -> Path:
        folder = self.root / kind / f"step-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    @contextlib.contextmanager
    def _trace(self, step: int) -> Iterator[None]:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            yield
        path = self._folder("profile_traces", step) / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(path))
        if self.rank == 0:
            logger.info("profiling: step %d traced to %s (one file per rank; open in ui.perfetto.dev)", step,
                        path.parent)

    @contextlib.contextmanager
    def _memory_snapshot(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=MAX_CUDA_EVENTS)
            try:
                yield
                path = self._folder("memory_snapshot", step) / f"rank{self.rank}_memory_snapshot.pickle"
                torch.cuda.memory._dump_snapshot(str(path))
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
            what = "open it at pytorch.org/memory_viz"
        else:
            with fsdp2.MemoryTracker(model, optimizer) as tracker:
                yield
            folder = self._folder("memory_snapshot", step)
            path = folder / f"rank{self.rank}_memory.txt"
            path.write_text(tracker.report.table() + "\n")
            (folder / f"rank{self.rank}_memory.json").write_text(
                json.dumps(dataclasses.asdict(tracker.report), indent=1) + "\n")
            what = "fsdp2.MemoryTracker's bytes by category at the step's peak"
        if self.rank == 0:
            logger.info("profiling: step %d memory snapshot in %s (one per rank; %s)", step, path.parent, what)
