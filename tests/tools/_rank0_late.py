"""``python _rank0_late.py SCRIPT ARGS...``: runs SCRIPT as ``__main__`` with ARGS, rank 0 (the
``RANK`` torchrun sets) a few seconds after the others. A loaded machine can leave rank 0 behind,
and torchrun stops every rank as soon as one exits: this makes that order certain for a test."""

import os
import runpy
import sys
import time

if os.environ.get("RANK") == "0":
    time.sleep(4.0)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
