"""What a run reports: one line per logged step, a JSON-lines metrics file, a PNG loss curve, TensorBoard."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["memory_mb", "gather_memory_mb", "MetricsWriter", "TensorBoardWriter", "check_tensorboard",
           "format_duration", "plot_loss", "flops_per_token"]

TENSORBOARD_INSTALL = "pip install -e '.[tensorboard]' (or pip install tensorboard)"


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


def check_tensorboard() -> None:
    """Raise ValueError, before any collective, if TensorBoard logging could not start."""
    try:
        import torch.utils.tensorboard  # noqa: F401  (imports the tensorboard package, or fails)
    except ImportError as e:
        raise ValueError(f"metrics.enable_tensorboard needs the tensorboard package ({e}): {TENSORBOARD_INSTALL}, "
                         "or leave metrics.enable_tensorboard off") from None


class TensorBoardWriter:
    """Writes each metrics record's numbers as TensorBoard scalars (rank 0 only), with torch's SummaryWriter.

    Tags: ``loss/train``, ``loss/validation``, ``lr``, ``grad_norm``, ``throughput/tokens_per_s``,
    ``throughput/tflops_per_rank``, ``throughput/mfu``, ``memory_mb/max`` (the largest rank's) and
    ``skipped_steps``, each at its step. A resumed run purges the events after the step it
    resumed from (SummaryWriter's ``purge_step``), so the curves read as one run, like the
    metrics file.
    """

    TAGS = {"loss": "loss/train", "val_loss": "loss/validation", "lr": "lr", "grad_norm": "grad_norm",
            "tokens_per_s": "throughput/tokens_per_s", "tflops_per_rank": "throughput/tflops_per_rank",
            "mfu": "throughput/mfu", "skipped_steps": "skipped_steps"}

    def __init__(self, folder: str | Path, *, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = Path(folder)
        self.writer = SummaryWriter(str(self.folder), purge_step=resume_step + 1 if resume_step else None)

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, tag in self.TAGS.items():
            if isinstance(record.get(key), (int, float)):
                self.writer.add_scalar(tag, record[key], step)
        if record.get("memory_mb"):
            self.writer.add_scalar("memory_mb/max", max(record["memory_mb"]), step)

    def close(self) -> None:
        self.writer.close()


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
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".", linewidth=1, label="training")
    validated = [r for r in records if "val_loss" in r]
    if validated:
        ax.plot([r["step"] for r in validated], [r["val_loss"] for r in validated], marker="o", linewidth=1,
                label="validation (held out)")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(str(metrics_path))
    ax.grid(alpha=0.3)
    out = metrics_path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
