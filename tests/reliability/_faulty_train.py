"""``recipes/train.py`` under torchrun with one fault injected into the first attempt's checkpoints.

Run by tests/reliability/test_checkpoint_faults.py as torchrun's script, with
``FSDP2_TEST_FAULT`` set to one of:

- ``torn:STEP``: rank 1 is SIGKILLed inside the save of STEP, once DCP has written its data
  file (at the fsync that follows), so the save is left half-written: a ``.tmp-<id>``
  directory with some files and no marker.
- ``async-torn:STEP``: with ``--checkpoint.async_mode=async``, rank 1 is SIGKILLed from the
  background thread writing the save of STEP (at the fsync after its data file), while its
  main thread trains on: the marker is never written.
- ``corrupt:STEP``: once the save of STEP is complete, rank 0 overwrites up to 64 KiB of its
  own ``.distcp`` file in place (same size, other bytes: a bad sector) and is SIGKILLed.

Only torchrun's first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) is faulted: the restart
must find the damage and resume from the checkpoint before it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading

import torch.distributed as dist

import recipes.train as train
from recipes.checkpoint import Checkpointer
from recipes.exit import run_and_exit

KIB_64 = 64 * 2**10


def overwrite_in_place(path: str | os.PathLike, *, offset: int = 1024, length: int = KIB_64) -> None:
    """Overwrite ``length`` bytes of ``path`` from ``offset`` (clipped to the file), keeping its size."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        offset = min(offset, size // 2)
        f.seek(offset)
        f.write(bytes((i * 73 + 41) % 256 for i in range(min(length, size - offset))))


def _inject(kind: str, at: int) -> None:
    save = Checkpointer.save
    fsync = os.fsync

    def faulty_save(self, step, *args, **kwargs):
        if step != at:
            return save(self, step, *args, **kwargs)
        if kind == "async-torn":
            # The previous save's background write ends first (collective, as save's own wait):
            # on a loaded machine it can still be writing, and the fsync below would kill it instead.
            self.wait()

            def die_in_the_background(fd: int) -> None:
                fsync(fd)
                if dist.get_rank() == 1 and threading.current_thread() is not threading.main_thread():
                    os.kill(os.getpid(), signal.SIGKILL)
            os.fsync = die_in_the_background
            return save(self, step, *args, **kwargs)
        if kind == "torn":
            def die_in_the_middle(fd: int) -> None:
                fsync(fd)
                if dist.get_rank() == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            os.fsync = die_in_the_middle
            return save(self, step, *args, **kwargs)
        path = save(self, step, *args, **kwargs)
        if dist.get_rank() == 0:
            overwrite_in_place(path / "__0_0.distcp")
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    Checkpointer.save = faulty_save


if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        kind, step = os.environ["FSDP2_TEST_FAULT"].split(":")
        _inject(kind, int(step))
    sys.argv[0] = train.__file__
    faulthandler.enable(all_threads=True)
    # As recipes/train.py ends: without interpreter finalization, which a gloo thread can abort
    # (SIGABRT, recipes/exit.py's Note), failing the restarted attempt of a run that finished.
    run_and_exit(train.main)
