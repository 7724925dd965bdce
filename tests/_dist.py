"""Multi-process test harness: a session-wide pool of gloo ranks per world size.

Starting a gloo world costs seconds, so each world size gets one pool of worker
processes that initialise ``torch.distributed`` once and then run many tests. Workers are
forked by a multiprocessing forkserver that imported this module (and torch) once, so a pool
starts without each worker importing torch again; a worker takes the test process's
environment as it is at the pool's start, as a spawned one would.
A test calls ``run_on_ranks(fn, world_size, *args, **kwargs)``; every rank imports
``fn`` by ``(module, qualname)``, runs it and sends back its return value or its
traceback. The pool never outlives a failure it cannot vouch for: a rank that does
not answer in time (usually stuck in a collective after a peer raised) gets the whole
pool killed, and the next call starts a fresh one.

Each task's stdout/stderr (fd level, so C++ output too) goes to a per-rank log file
that the parent replays with a ``[rank r]`` prefix, so pytest shows it with the test.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import importlib
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

__all__ = ["run_on_ranks", "shutdown_pools", "skip_unless_cuda"]

skip_unless_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120.0  # 8 ranks on 2 cores take a while to import torch and rendezvous
GRACE_S = 15.0  # how long peers of a failed rank get before we call them hung
HEALTH_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 5.0


@dataclass
class _Pool:
    """One live world: ``world_size`` worker processes and a pipe to each."""

    world_size: int
    procs: list[mp.process.BaseProcess]
    conns: list[Connection]
    log_dir: Path
    next_task: int = 0
    dead: bool = field(default=False)

    def healthy(self) -> bool:
        return not self.dead and all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        self.dead = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=SHUTDOWN_TIMEOUT_S)
        for c in self.conns:
            c.close()
        shutil.rmtree(self.log_dir, ignore_errors=True)

    def shutdown(self) -> None:
        """Ask workers to leave the process group and exit; kill whoever lingers."""
        if self.dead:
            return
        for c in self.conns:
            try:
                c.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()


_POOLS: dict[int, _Pool] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context() -> mp.context.BaseContext:
    """Workers fork from a forkserver that imported this module (and torch) once, instead of each
    spawned worker importing torch again: 2 + 4 ranks started in 7 s instead of 33 s on 2 busy cores.
    Where CUDA is available, spawned: importing this module queries CUDA (``skip_unless_cuda``),
    after which torch refuses CUDA in a forked child ("Cannot re-initialize CUDA in forked
    subprocess"; seen on the H200, 2026-11-26), and the cuda tests' workers use the GPU."""
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # DTensor and dynamo (which ``distribute_tensor`` imports on first use) too: 1.2 s of CPU per
    # worker otherwise, paid again at every pool start (10 s for the 8-rank pool).
    ctx.set_forkserver_preload([__name__, "torch.distributed.tensor", "torch._dynamo"])
    return ctx


def _start_pool(world_size: int) -> _Pool:
    ctx = _context()
    port = _free_port()
    log_dir = Path(tempfile.mkdtemp(prefix=f"fsdp2-ws{world_size}-"))
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        p = ctx.Process(
            target=_worker_main,
            args=(rank, world_size, port, child_conn, dict(os.environ)),
            name=f"fsdp2-test-rank{rank}",
            daemon=True,
        )
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)
    pool = _Pool(world_size, procs, conns, log_dir)
    deadline = time.monotonic() + START_TIMEOUT_S
    for rank, conn in enumerate(conns):
        remaining = deadline - time.monotonic()
        if not conn.poll(max(0.0, remaining)):
            pool.kill()
            raise RuntimeError(f"rank {rank} of a {world_size}-rank gloo world did not start "
                               f"within {START_TIMEOUT_S} s")
        try:
            status, payload = pickle.loads(conn.recv_bytes())
        except EOFError:
            procs[rank].join(timeout=SHUTDOWN_TIMEOUT_S)
            status, payload = "error", f"exited with code {procs[rank].exitcode} (see its stderr)"
        if status != "ready":
            pool.kill()
            raise RuntimeError(f"rank {rank} failed to join the gloo world:\n{payload}")
    return pool


def _get_pool(world_size: int) -> _Pool:
    pool = _POOLS.get(world_size)
    if pool is None or not pool.healthy():
        if pool is not None:
            pool.kill()
        pool = _POOLS[world_size] = _start_pool(world_size)
    return pool


def _discard(pool: _Pool) -> None:
    pool.kill()
    if _POOLS.get(pool.world_size) is pool:
        del _POOLS[pool.world_size]


def shutdown_pools() -> None:
    """Stop every pool; called at pytest session end and at interpreter exit."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.shutdown()


atexit.register(shutdown_pools)

# Every process group a task makes (``new_group``, a mesh's axes) keeps gloo's I/O threads in
# the pool's workers for the pool's life, and hundreds of them cost an idle worker a fifth of a
# core (4 workers of 896 threads each: 22% each, most of a core of the CI's two, paid by every
# later test). Between tests, a pool past this many threads in a worker is stopped; the next
# call starts a fresh one (a few seconds).
MAX_WORKER_THREADS = 256


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:  # not Linux, or already gone
        return 0


def retire_crowded_pools() -> None:
    """Stop the pools whose workers hold more than ``MAX_WORKER_THREADS`` threads (between tests)."""
    for world_size, pool in list(_POOLS.items()):
        if any(_threads(p.pid) > MAX_WORKER_THREADS for p in pool.procs if p.pid is not None):
            del _POOLS[world_size]
            pool.shutdown()


@contextlib.contextmanager
def info_records(logger: logging.Logger) -> Iterator[list[logging.LogRecord]]:
    """The records ``logger`` emits at INFO and above inside the block (its level lowered to INFO)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextlib.contextmanager
def environ(name: str, value: str) -> Iterator[None]:
    """Set environment variable ``name`` inside the block, then put back what was there."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120.0,
    grace: float = GRACE_S,
    **kwargs: Any,
) -> list[Any]:
    """Run module-level ``fn(*args, **kwargs)`` on every rank; return the values by rank.

    Every rank runs with ``torch.manual_seed(0)`` and one intra-op thread in a gloo world
    that persists across calls. ``timeout`` bounds the whole call; once any rank fails,
    the others get ``grace`` seconds before they are declared hung and the pool is killed.

    Raises:
        AssertionError: some rank raised, died or did not finish; the message holds every
            failing rank's traceback, labelled by rank.
    """
    __tracebackhide__ = True  # pytest: show the ranks' tracebacks, not this frame
    if "<locals>" in fn.__qualname__ or fn.__module__ == "__main__":
        raise TypeError(f"run_on_ranks needs a module-level function of an importable module, "
                        f"got {fn.__module__}.{fn.__qualname__}")
    pool = _get_pool(world_size)
    task_id = pool.next_task
    pool.next_task += 1
    logs = [pool.log_dir / f"task{task_id}.rank{r}.log" for r in range(world_size)]
    for rank, conn in enumerate(pool.conns):
        msg = (fn.__module__, fn.__qualname__, args, kwargs, str(logs[rank]))
        conn.send_bytes(pickle.dumps(msg))

    try:
        results, errors = _collect(pool, timeout, grace)
        _dump_stacks(pool, [r for r in range(world_size) if r not in results])
    except BaseException:  # e.g. Ctrl-C: the ranks are mid-task, so the pool is unusable
        _discard(pool)
        raise
    finally:
        _replay_logs(logs)
    name = f"{fn.__module__}.{fn.__qualname__}"
    # A rank that never answered or died leaves the world unusable; a failure that every
    # rank survived may still have desynchronised the collectives, so probe before reuse.
    if len(results) < world_size or not pool.healthy() or (errors and not _health_check(pool)):
        _discard(pool)
    if errors:
        body = "\n\n".join(f"===== rank {r} =====\n{errors[r]}" for r in sorted(errors))
        raise AssertionError(f"{name} failed on rank(s) {sorted(errors)} "
                             f"of {world_size}:\n\n{body}")
    return [results[r] for r in range(world_size)]


def _collect(pool: _Pool, timeout: float, grace: float) -> tuple[dict[int, Any], dict[int, str]]:
    """Wait for every rank's answer, or until ``timeout`` / the post-failure grace runs out."""
    start = time.monotonic()
    deadline = start + timeout
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    waiting = {c: r for r, c in enumerate(pool.conns)}
    waiting.update({pool.procs[r].sentinel: r for r in range(pool.world_size)})
    first_failure: int | None = None
    while len(results) < pool.world_size:
        now = time.monotonic()
        if now >= deadline:
            break
        for obj in wait(list(waiting), timeout=deadline - now):
            rank = waiting.pop(obj)
            if rank in results:
                continue
            conn = pool.conns[rank]
            # A sentinel fires on exit; the answer may still sit in the pipe before the EOF.
            reply = ("error", f"worker process died with exit code {pool.procs[rank].exitcode}")
            if isinstance(obj, Connection) or conn.poll(0):
                try:
                    reply = pickle.loads(conn.recv_bytes())
                except EOFError:
                    if isinstance(obj, Connection):
                        continue  # the sentinel reports the death
            status, payload = reply
            results[rank] = payload if status == "ok" else None
            if status != "ok":
                errors[rank] = payload
            if rank in errors and first_failure is None:
                first_failure = rank
                deadline = min(deadline, time.monotonic() + grace)
    for rank in range(pool.world_size):
        if rank not in results:
            why = (f"did not finish within {grace} s after rank {first_failure} failed "
                   f"(likely stuck in a collective)" if first_failure is not None
                   else f"did not finish within {timeout} s")
            errors[rank] = (f"rank {rank} {why}; its Python stack is in the captured output; "
                            f"the pool was killed and will be restarted")
    return results, errors


def _dump_stacks(pool: _Pool, ranks: list[int]) -> None:
    """Have hung ranks print their Python stack (faulthandler) into their task log."""
    for rank in ranks:
        if pool.procs[rank].is_alive():
            os.kill(pool.procs[rank].pid, signal.SIGUSR1)
    if ranks:
        time.sleep(0.5)


def _health_check(pool: _Pool) -> bool:
    """After a failure that every rank survived, check the world still reduces correctly."""
    try:
        for conn in pool.conns:
            conn.send_bytes(pickle.dumps((__name__, "_health_probe", (), {}, os.devnull)))
    except OSError:  # a rank exited after it answered (BrokenPipeError): the pool is gone
        return False
    results, errors = _collect(pool, HEALTH_TIMEOUT_S, HEALTH_TIMEOUT_S)
    n = pool.world_size
    return not errors and all(v == n * (n + 1) / 2 for v in results.values())


def _health_probe() -> float:
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _replay_logs(logs: list[Path]) -> None:
    for rank, path in enumerate(logs):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        path.unlink(missing_ok=True)
        if text:
            sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    sys.stdout.flush()


# --------------------------------------------------------------------------- worker side


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so a killed pytest leaves no orphans."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_main(rank: int, world_size: int, port: int, conn: Connection, env: dict[str, str]) -> None:
    _die_with_parent()
    os.environ.clear()  # the test process's environment now, as a spawned worker's (not the forkserver's)
    os.environ.update(env)
    os.environ.update(FSDP2_TEST_WORKER="1", RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Writes to fd 2, which points at the current task's log while a task runs.
    faulthandler.register(signal.SIGUSR1, all_threads=False)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port}")
    except Exception:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            task = pickle.loads(conn.recv_bytes())  # blocks while idle
        except EOFError:
            return  # parent went away
        if task is None:
            # Skip destroy_process_group: the whole world is exiting, and gloo's teardown
            # only adds seconds to the end of the session.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        conn.send_bytes(_run_task(*task))


def _run_task(module: str, qualname: str, args: tuple, kwargs: dict, log_path: str) -> bytes:
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    with _redirect_fds(log_path):
        try:
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            reply = ("ok", obj(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - pytest.fail/skip raise BaseException subclasses
            reply = ("error", traceback.format_exc())
    try:
        return pickle.dumps(reply)
    except Exception:
        return pickle.dumps(("error", f"return value is not picklable:\n{traceback.format_exc()}"))


class _redirect_fds:
    """Point fds 1 and 2 at ``path`` for one task (fd level, so C++ writes land there too)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = (os.dup(1), os.dup(2))
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, saved in zip((1, 2), self.saved):
            os.dup2(saved, target)
            os.close(saved)
