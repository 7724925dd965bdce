"""What a crash costs: the same SIGKILL recovered from in-memory snapshots and from disk checkpoints.

    python benchmarks/recovery.py --steps 40 --seed 0 --rounds 2

One invocation draws a kill step at random (``--seed``; uniform over 11 .. steps - 5) and
launches the demo recipe (recipes/configs/tiny.toml, ``--steps`` steps, 2 CPU ranks, gloo)
twice under ``torchrun --max-restarts 1``, both with disk checkpoints every 10 steps and
``faults.kill_after_step`` set to that step (rank 1 SIGKILLed once the step is done):

- ``snapshots``: with ``--checkpoint.snapshot_every=1`` (a snapshot after every step);
- ``disk``: without snapshots.

``--rounds`` repeats the pair, the order alternating (snapshots first in the first round, disk
first in the second, and so on: the machine's load drifts between launches). For each launch
it prints one JSON line: where the run resumed from, the steps lost (finished steps the
restarted run repeats), and the seconds from the kill to the first new step (from the moment
the killed step's line reaches this script to the moment the first resumed step's line does:
torchrun noticing the death, stopping and restarting the ranks, their start, the restore, and
the first step).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "recipes" / "train.py"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps of each run (at least 20)")
    parser.add_argument("--seed", type=int, default=0, help="draws the kill step")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of launches, in alternating order")
    return parser


def launch(name: str, extra: list[str], kill: int, steps: int, root: Path) -> dict:
    """One torchrun launch, its output read line by line with the time each line arrived."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.1", str(TRAIN), f"--steps={steps}",
           "--metrics.log_every=1", "--metrics.sample_tokens=0", "--metrics.plot=false",
           "--checkpoint-dir", str(root / name), "--checkpoint-every", "10", f"--faults.kill_after_step={kill}",
           "--faults.kill_rank=1", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    killed_at = first_new_at = None
    resumed, lines = None, []
    for line in proc.stdout:
        now = time.perf_counter()
        lines.append(line)
        if killed_at is None and re.match(rf"step\s+{kill}/{steps} ", line):
            killed_at = now
        if match := re.search(r"resumed from (snapshot|checkpoint) (\S+) step (\d+)", line):
            resumed = (match.group(1), int(match.group(3)))
        elif resumed is None and (match := re.search(r"checkpoint: resumed from (\S+) at step (\d+)", line)):
            resumed = ("checkpoint", int(match.group(2)))
        if resumed and first_new_at is None and re.match(rf"step\s+{resumed[1] + 1}/{steps} ", line):
            first_new_at = now
    if proc.wait() != 0 or killed_at is None or resumed is None or first_new_at is None:
        raise SystemExit(f"{name}: the launch did not crash and resume as expected:\n{''.join(lines)}")
    return {"recovery": name, "kill_after_step": kill, "resumed_from": resumed[0], "resumed_step": resumed[1],
            "steps_lost": kill - resumed[1], "kill_to_first_new_step_s": round(first_new_at - killed_at, 2),
            "steps": steps, "world": 2, "transport": "gloo (CPU)"}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.steps < 20:
        raise SystemExit("--steps must be at least 20 (the kill is drawn from 11 .. steps - 5)")
    kill = random.Random(args.seed).randint(11, args.steps - 5)
    with tempfile.TemporaryDirectory(prefix="fsdp2-recovery-") as tmp:
        pair = [("snapshots", ["--checkpoint.snapshot_every=1"]), ("disk", [])]
        for round_ in range(args.rounds):
            for name, extra in pair if round_ % 2 == 0 else pair[::-1]:
                row = launch(name, extra, kill, args.steps, Path(tmp) / str(round_))
                print(json.dumps({**row, "round": round_}), flush=True)


if __name__ == "__main__":
    main()
