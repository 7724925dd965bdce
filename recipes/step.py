"""One training step, the held-out loss, and the guard that stops a run whose steps keep being skipped.

``train_step`` runs ``grad_accum`` micro-batches (or this rank's pipeline stages), clips with
fsdp2's ``clip_grad_norm_`` and skips the optimizer step when the gradient norm is not finite;
``SkipGuard`` counts those skips (its counters go into checkpoints); ``validate`` is the loss on
held-out batches, averaged over the ranks.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp2

from .config import JobConfig, TrainingConfig
from .data import get_batch
from .launch import log
from .llama.model import Transformer
from .pipeline import Pipeline


class StepResult(NamedTuple):
    loss: torch.Tensor  # this rank's loss (mean over its micro-batches), not yet averaged over ranks
    grad_norm: float  # the global gradient norm before clipping, identical on every rank
    lr: float  # the learning rate this step used (or would have used, if skipped)
    skipped: bool  # the gradient norm was not finite: no optimizer step was taken


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
               corpus: torch.Tensor, step: int, dp_rank: int, t: TrainingConfig,
               device: torch.device, *, poison: bool = False, pipeline: Pipeline | None = None) -> StepResult:
    """One optimizer step over ``t.grad_accum`` micro-batches, or none if the gradients are not finite.

    ``poison`` multiplies the loss by NaN (``faults.nan_loss_at_steps``: a bad batch on demand,
    to test the skip). ``pipeline``: the batches run through this rank's pipeline stages instead.
    """
    loss_sum = torch.zeros((), device=device)
    if pipeline is not None:
        loss_sum = pipeline.forward_backward(corpus, step, dp_rank, t, device, poison=poison)
    # Every micro-batch's backward reduce-scatters its gradients, which accumulate on the
    # sharded .grad; dividing each loss by grad_accum makes the sum the mean.
    for micro in range(t.grad_accum if pipeline is None else 0):
        inputs, targets = get_batch(corpus, seed=t.seed, step=step, rank=dp_rank, micro=micro,
                                    batch_size=t.batch_size, seq_len=t.seq_len)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        logits = model(inputs)  # (batch, seq, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / t.grad_accum
        if poison:
            loss = loss * float("nan")
        loss.backward()
        loss_sum += loss.detach()
    # The norm of the full gradient, identical on every rank. fsdp2's clip_grad_norm_, not
    # torch's: under FSDP x TP some gradients live on the dp mesh and some on the (dp, tp)
    # mesh, and torch's cannot combine norms across meshes. Pipelined, over every stage's gradients.
    grad_norm = fsdp2.clip_grad_norm_(model.parameters(), t.max_grad_norm or float("inf"),
                                      pp_mesh=pipeline.pp_mesh if pipeline is not None else None).item()
    lr = scheduler.get_last_lr()[0]  # the rate this step uses
    # A bad batch: a non-finite loss on any rank makes its gradients, and so the global norm,
    # non-finite. The norm is the same on every rank, so all of them skip together with no
    # extra collective. The gradients are dropped below; the weights and AdamW's moments and
    # step count stay as they were.
    skipped = not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
    with warnings.catch_warnings():
        # When the first steps are skipped, torch warns that the scheduler steps before the
        # optimizer ever did; here that is on purpose.
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()` before")
        scheduler.step()  # also when skipped: the learning rate stays a function of the step number
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, grad_norm, lr, skipped)


@torch.no_grad()
def validate(model: Transformer, held_out: torch.Tensor, dp_rank: int, config: JobConfig,
             device: torch.device) -> float:
    """Collective: the mean loss on ``validation.steps`` held-out batches per data-parallel rank, over all ranks.

    The same batches every time (the batch function at step 0, on the held-out bytes), so the
    numbers of one run are comparable; no gradients, no state changed.
    """
    t, steps = config.training, config.validation.steps
    total = torch.zeros((), device=device)
    for i in range(steps):
        inputs, targets = get_batch(held_out, seed=t.seed, step=0, rank=dp_rank, micro=i,
                                    batch_size=t.batch_size, seq_len=t.seq_len)
        logits = model(inputs.to(device))  # (batch, seq, vocab)
        total += F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten())
    total /= steps
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total.item()


class SkipGuard:
    """Counts skipped steps and stops the run after ``limit`` in a row (0: never).

    Its counters go into every checkpoint, so a resumed run stops where the uninterrupted
    one would have.
    """

    def __init__(self, limit: int) -> None:
        self.limit, self.total, self.in_a_row = limit, 0, 0

    def update(self, step: int, skipped: bool) -> None:
        self.total += skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if skipped:
            limit = f"the run stops at {self.limit}" if self.limit else "no limit"
            log(f"warning: step {step}: the gradient norm is not finite; skipped the optimizer step "
                f"({self.in_a_row} in a row, {limit}: training.max_skipped_steps)")

    def check(self, step: int) -> None:
        """Raise once ``limit`` steps in a row were skipped (every rank: the decision is global)."""
        if self.limit and self.in_a_row >= self.limit:
            raise RuntimeError(
                f"steps {step - self.in_a_row + 1}-{step}: {self.in_a_row} steps in a row had a non-finite "
                f"gradient norm and were skipped (training.max_skipped_steps={self.limit}). The run is diverging "
                "or the data is bad: resume from an earlier checkpoint with a lower training.lr, or check the "
                "data of these steps; raise training.max_skipped_steps (0: no limit) to skip more")

    def state_dict(self) -> dict[str, int]:
        return {"total": self.total, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total, self.in_a_row = state["total"], state["in_a_row"]
