"""The recipe's process around training: rank 0's lines, a clean failure, Ctrl-C, torchrun's restarts.

``recipes/train.py``'s ``main`` calls these: ``fail`` stops a rank with one line and exit code 2
(and the line in torchrun's error file); ``Interrupted`` and ``ctrl_c_after`` turn Ctrl-C into one
line naming the checkpoint to resume from; ``log`` prints on rank 0 of the process group.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Iterator, NoReturn

import torch.distributed as dist

from .checkpoint import Checkpointer


def log(*args: object) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


_WAIT_FOR_RANK0_S = 60.0


def fail(message: str, rank0: bool) -> NoReturn:
    """Stop this rank with exit code 2 after a clean error: one line on rank 0's stderr.

    Under torchrun, every rank also writes the line to its error file (``TORCHELASTIC_ERROR_FILE``,
    see torch.distributed.elastic's errors docs), so the failure report torchrun prints after
    it names the error instead of "To enable traceback see ...". That report itself (about 30
    lines) comes from torchrun's own process, which a worker cannot silence.
    """
    if rank0:
        print(message, file=sys.stderr)
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with open(error_file, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
    if not rank0 and "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun stops every rank once the first exits, so a rank that left before rank 0 had
        # printed would cut its line off; every rank fails alike, but a loaded machine may run
        # rank 0 seconds behind (a 2 s wait lost that race, 2026-11-29). So the others stay until
        # rank 0's exit makes torchrun stop them (SIGTERM); the bound covers a rank 0 that is gone.
        time.sleep(_WAIT_FOR_RANK0_S)
    sys.exit(2)


def show_recipe_logs(rank0: bool) -> None:
    """Print the recipe's own log records (checkpoint saves, prunes, resumes...) on rank 0, one line each."""
    if not rank0:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_RecipeFormatter())
    recipe_logger = logging.getLogger("recipes")
    recipe_logger.addHandler(handler)
    recipe_logger.setLevel(logging.INFO)


class _RecipeFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = "warning: " if record.levelno >= logging.WARNING else ""
        return prefix + record.getMessage()


@contextlib.contextmanager
def ctrl_c_after() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) until the block is done, then deliver it as the process would have
    (``KeyboardInterrupt`` under Python's default handler; nothing where SIGINT is ignored).

    Around a checkpoint save: interrupted inside, DCP's collectives turn the interrupt into a
    ``CheckpointException`` traceback and leave the save half-written; held, the save completes
    (every rank gets the signal from torchrun, so every rank finishes it) and the run stops with
    its one line, naming that checkpoint.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        signal.raise_signal(signal.SIGINT)  # to the handler (or disposition) the block held it from


class Interrupted(Exception):
    """Ctrl-C during training; the message says at which step, the last checkpoint and how to resume."""

    def __init__(self, step: int, checkpointer: Checkpointer | None, every: int) -> None:
        last = checkpointer.newest_saved() if checkpointer is not None else None
        if checkpointer is None:
            hint = "no checkpoints (no --checkpoint-dir): a rerun starts from step 0"
        elif last is None:
            when = f"the first is due at step {every}" if every else "the only one is due at the last step"
            hint = f"no checkpoint in {checkpointer.root} yet ({when}): a rerun starts from step 0"
        else:
            hint = f"the last checkpoint is step {last} in {checkpointer.root}: run the same command to resume from it"
        super().__init__(f"interrupted during step {step}; {hint}")


def restart_store_problem() -> str | None:
    """Why torchrun's restarts would fail to reconnect the ranks, or None.

    torch >= 2.5 lets the workers share torchrun's rendezvous store by default, and that store
    outlives a restart: the restarted workers read the previous attempt's addresses from it and
    their process group fails to connect (pytorch/pytorch#135712), using up the restarts.
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (f"torchrun --max-restarts {restarts} with the shared rendezvous store: restarted ranks may fail "
                "to connect (pytorch/pytorch#135712); launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    return None
