"""What a run reports: one line per logged step, a JSON-lines metrics file, a PNG loss curve."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["memory_mb", "gather_memory_mb", "MetricsWriter", "format_duration", "plot_loss", "flops_per_token"]


def flops_per_token(n_params: int, n_embedding_params: int, n_layers: int, dim: int, seq_len: int) -> int:
    """Training FLOPs per token of a decoder-only transformer, as torchtitan and PaLM's MFU count them.

    6 per parameter outside the embedding table (2 forward, 4 backward: one multiply-add per
    weight per token), plus attention's scores and weighted sum, 12 x layers x dim x seq_len
    (``dim`` = heads x head_dim). Recomputation under activation checkpointing is not counted,
    so the model FLOPs utilisation (MFU) stays comparable between runs with and without it.
    """
    return 6 * (n_params - n_embedding_params) + 12 * n_layers * dim * seq_len


def memory_mb(device: torch.device) -> float:
    """This rank's memory in MiB: peak allocated on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/statm") as f:  # current RSS, in pages (Linux)
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # peak, KiB on Linux


def gather_memory_mb(device: torch.device) -> list[float]:
    """Collective: every rank's :func:`memory_mb`, in rank order."""
    mine = torch.tensor([memory_mb(device)], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.item() for t in every]


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class MetricsWriter:
    """Appends one JSON object per logged step to ``path`` (rank 0 only).

    On resume the records after the resumed step (logged by the interrupted run but not
    covered by its checkpoint) are dropped, so the file reads as one uninterrupted run: each
    step once, in order. A line cut short by a crash mid-write is dropped too (it is always
    after the resumed step: a step is recorded before it is checkpointed). The file is
    rewritten atomically (a temporary file renamed over it), so a crash while resuming loses
    nothing either.
    """

    def __init__(self, path: str | Path, *, resume_step: int) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step > 0 and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if (record := _parse(line)) is not None and record["step"] <= resume_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def _parse(line: str) -> dict[str, Any] | None:
    """A metrics line's record; None for a blank or cut-off line."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "step" in record else None


def plot_loss(metrics_path: str | Path) -> Path | None:
    """Draw loss against step from a metrics file into ``<metrics>.png``; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    metrics_path = Path(metrics_path)
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title(str(metrics_path))
    ax.grid(alpha=0.3)
    out = metrics_path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
