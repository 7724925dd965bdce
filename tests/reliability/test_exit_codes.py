"""A finished run exits 0 on every rank; a stopped one keeps its exit code (recipes/exit.py).

- ``run_and_exit`` (plain Python subprocesses, no torch): a ``main`` that returns exits 0
  after its non-daemon threads have finished, the ``atexit`` handlers have run and buffered
  stdout has been written; ``sys.exit(n)`` exits ``n``, ``sys.exit("message")`` prints it
  and exits 1; an exception or an uncaught Ctrl-C leaves as Python leaves without it
  (traceback and 1; SIGINT).
- ``torchrun recipes/train.py`` launched 20 times, 3 at a time, across the configurations
  that have aborted at exit (``terminate called without an active exception``): 2 ranks
  plain, 2 ranks with activation checkpointing, 2 ranks with the profiler, TensorBoard,
  validation and a sample, 4 ranks FSDP, 4 ranks with activation checkpointing; every launch
  must exit 0, and a failure reports every launch's code and the tail of its output. Side by
  side loses nothing: the abort showed up on a loaded machine.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes" / "train.py"


# ---- run_and_exit: what a normal exit does, then os._exit -------------------------------------
def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text("import atexit, sys, threading, time\nfrom recipes.exit import run_and_exit\n"
                      + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_a_finished_main_exits_0_after_threads_atexit_and_stdout(tmp_path):
    proc = _run(tmp_path, f"""
        def late():
            time.sleep(0.5)
            open({str(tmp_path / 'thread')!r}, 'w').write('done')
        def main():
            atexit.register(lambda: print('atexit ran', end=''))  # no newline: stays buffered
            threading.Thread(target=late).start()
            print('main returned')
        run_and_exit(main)
        print('never printed')
    """)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "main returned\natexit ran", "")
    assert (tmp_path / "thread").read_text() == "done"  # the non-daemon thread was waited for


@pytest.mark.parametrize("call, code, stderr", [
    ("sys.exit(3)", 3, ""), ("sys.exit(130)", 130, ""), ("sys.exit(None)", 0, ""), ("sys.exit(256 + 2)", 2, ""),
    ("sys.exit('error: bad')", 1, "error: bad\n"),
])
def test_sys_exit_keeps_its_code(tmp_path, call, code, stderr):
    proc = _run(tmp_path, f"""
        def main():
            atexit.register(lambda: print('atexit ran'))
            {call}
        run_and_exit(main)
    """)
    assert (proc.returncode, proc.stdout, proc.stderr) == (code, "atexit ran\n", stderr)


def test_an_exception_or_ctrl_c_leaves_as_without_it(tmp_path):
    crash = _run(tmp_path, """
        def main():
            raise RuntimeError('boom')
        run_and_exit(main)
    """)
    assert crash.returncode == 1
    assert crash.stderr.startswith("Traceback") and crash.stderr.endswith("RuntimeError: boom\n")
    interrupted = _run(tmp_path, """
        def main():
            raise KeyboardInterrupt
        run_and_exit(main)
    """)
    assert interrupted.returncode == -2  # Python re-raises an uncaught Ctrl-C as SIGINT
    assert interrupted.stderr.rstrip().endswith("KeyboardInterrupt")


# ---- the recipe under torchrun, 20 times ---------------------------------------------------------
SHORT = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.max_seq_len=32",
         "--training.seq_len=32", "--training.batch_size=2", "--training.steps=2", "--training.warmup_steps=1",
         "--metrics.sample_tokens=0", "--metrics.plot=false", "--skip-memory-check"]
AC = ["--training.activation_checkpoint"]


def _has_tensorboard() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def _configs(dump: Path) -> dict[str, tuple[int, list[str]]]:
    """name -> (ranks, flags): the runs that have aborted at exit, and a plain one."""
    monitoring = [*AC, "--profiling.trace_steps=2", "--validation.enable", "--validation.steps=1",
                  "--metrics.sample_tokens=2", f"--job.dump_folder={dump}"]
    if _has_tensorboard():
        monitoring.append("--metrics.enable_tensorboard")
    return {"2 ranks": (2, []), "2 ranks, activation checkpointing": (2, AC),
            "2 ranks, profiler + monitoring": (2, monitoring), "4 ranks": (4, []),
            "4 ranks, activation checkpointing": (4, AC)}


def _launch(i: int, tmp_path: Path, data: Path) -> tuple[str, int, str]:
    """Launch ``i``: (its configuration's name, torchrun's exit code, the tail of its output)."""
    configs = list(_configs(tmp_path / f"dump-{i}").items())  # a dump folder per launch: some run side by side
    name, (ranks, flags) = configs[i % len(configs)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           str(TRAIN), *SHORT, "--data", str(data), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    return name, proc.returncode, (proc.stdout + proc.stderr)[-1500:]


@pytest.mark.slow  # 20 torchrun launches: minutes on 2 cores
def test_twenty_finished_runs_exit_0_on_every_rank(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text((REPO / "recipes" / "data.py").read_text())  # a few KB: loads at once
    # 3 at a time (the launches share nothing they write): the abort showed up on a loaded machine.
    with ThreadPoolExecutor(max_workers=3) as pool:
        launches = list(pool.map(lambda i: _launch(i, tmp_path, data), range(20)))
    failed = [(i, *launch) for i, launch in enumerate(launches) if launch[1] != 0]
    report = "\n".join(f"launch {i}: {name}: exit code {code}" for i, (name, code, _) in enumerate(launches))
    details = "\n\n".join(f"== launch {i}: {name} (exit code {code}), output's tail:\n{tail}"
                          for i, name, code, tail in failed)
    assert not failed, f"{len(failed)} of 20 launches failed:\n{report}\n\n{details}"
