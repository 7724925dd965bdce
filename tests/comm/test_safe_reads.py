"""Same-host reads are safe: memory a peer may read outlives the model, the gradients and the
process that offered it; reads check their places; Yama is handled per job; fsdp2 imports and
trains where the CPU transport cannot run (``fsdp2/comm/cpu/_lease.py``, ``_cma.py``, ``_yama.py``).

The rank that drops its memory (deletes the model, drops the gradients, exits) then allocates
and fills memory of the same size, so that a read of freed memory gets the wrong bytes or
fails, instead of finding the old values by luck.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import textwrap
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fsdp2
from fsdp2.runtime._state import get_state
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from fsdp2.comm.cpu._transport import probe_reads
from fsdp2.comm.cpu import _cma, _exchange, _lease, _pipes, _yama
from tests._dist import REPO_ROOT, environ, info_records, run_on_ranks
from tests._together import launched_together
from tests._models import MLP


@contextlib.contextmanager
def _reading_group(pipes: bool) -> Iterator[dist.ProcessGroup]:
    """A new process group over every rank whose ranks read each other; its small messages
    on pipes or on gloo."""
    pg = dist.new_group(timeout=datetime.timedelta(seconds=60))
    try:
        with environ(_pipes.PIPES_ENV, "1" if pipes else "0"):
            assert probe_reads(pg)
        assert isinstance(_pipes.link(pg), _pipes.Pipes) == pipes
        yield pg
    finally:
        dist.destroy_process_group(pg)


def _scribble(nbytes: int) -> list[torch.Tensor]:
    """Take memory the size of what was dropped, several times over, and fill it."""
    return [torch.full((nbytes // 4 + 1024 * k,), -7.0) for k in range(8)]


def _released_soon() -> bool:
    """Whether every lease of this process is released within 20 s (the peers acknowledged)."""
    return not _lease.drain(20.0) and not _lease.live()


# ---- a model deleted mid-iteration ---------------------------------------------------------

def _model_deleted_mid_iteration(when: str, pipes: bool) -> list[object]:
    """Rank 0 deletes its model (and collects it) while rank 1 has yet to read rank 0's chunk
    of the unsharded parameters; rank 1 reads it afterwards and must get the right values.

    ``after_unshard``: rank 0 dropped an all-gather it never waited for (it will not read
    rank 1 either, and says so). ``after_forward``: rank 0 finished its forward (the root
    keeps its parameters), and only the peer's read of rank 0 is outstanding. Both after a
    first iteration, so that the second forward runs no collective but the all-gather.
    """
    with _reading_group(pipes) as pg:
        mesh = DeviceMesh.from_group(pg, "cpu", mesh_dim_names=(f"safe_{pg.group_name}",))
        torch.manual_seed(0)
        model = MLP(256)
        full = [p.detach().clone() for p in model.parameters()]
        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
        expected = model(x).detach()
        with environ(CPU_COLLECTIVES_ENV, "read"):
            fsdp2.fully_shard(model, mesh=mesh, reshard_after_forward=False)
        model(x).sum().backward()  # a first iteration on every rank: lazy init and its checks
        group = get_state(model).group
        nbytes = group._unsharded_bytes()
        me = pg.rank()
        if me == 1 or when == "after_unshard":
            handle = model.unshard(async_op=True)  # offers this rank's chunk
        if me == 0:
            if when == "after_forward":
                dist.barrier(group=pg)  # rank 1 has offered its chunk
                model(x)  # reads rank 1's chunk, acknowledges; rank 1 has not read rank 0's
            else:
                assert isinstance(group._gather.exchange.exchange, _exchange.ReadExchange)
                del handle
            alive = weakref.ref(group)
            del model, group
            gc.collect()
            junk = _scribble(nbytes)
            dist.barrier(group=pg)  # rank 1 reads now
            dist.barrier(group=pg)  # rank 1 has read and acknowledged
            del junk
            return [alive() is None, _released_soon()]
        if when == "after_forward":
            dist.barrier(group=pg)
        dist.barrier(group=pg)  # rank 0's model is gone
        out = model(x)  # finishes the all-gather: reads rank 0's chunk out of a deleted model
        right = all(torch.equal(p.detach(), f) for p, f in zip(model.parameters(), full))
        model.reshard()  # needs rank 0's acknowledgement, read or not
        dist.barrier(group=pg)
        return [right, torch.allclose(out, expected), _released_soon()]


@pytest.mark.parametrize("pipes", [True, False], ids=["pipes", "gloo"])
@pytest.mark.parametrize("when", ["after_unshard", "after_forward"])
def test_a_model_deleted_mid_iteration_stays_readable_until_the_peer_has_read(when, pipes):
    # Rank 0: its model was collected, and its lease let go once rank 1 acknowledged.
    assert run_on_ranks(_model_deleted_mid_iteration, 2, when, pipes) == [[True, True], [True, True, True]]


def _gradients_dropped_mid_reduce_scatter(pipes: bool) -> list[object]:
    """Rank 0 starts a read reduce-scatter, then drops it and its gradients; rank 1 reads
    rank 0's chunk of them afterwards and must get the right sum."""
    with _reading_group(pipes) as pg:
        me = pg.rank()
        grads = [torch.arange(512 * 256, dtype=torch.float32).view(512, 256) * (k + 1) + 1000 * me
                 for k in range(2)]
        mine = [g.view(2, 256, 256)[1] for g in grads]  # rank 1's chunk of each, as rank 1 sees it here
        header = torch.zeros(16, dtype=torch.uint8)
        rs = _exchange.start_reduce_scatter([g.view(2, 256, 256) for g in grads], grads, [], torch.float32,
                                            header, pg, "a dropped reduce-scatter", read=True)
        rs.header_exchange.wait()
        if me == 0:
            alive = weakref.ref(grads[0])
            nbytes = sum(g.numel() * 4 for g in grads)
            del rs, grads, mine
            gc.collect()
            junk = _scribble(nbytes)
            dist.barrier(group=pg)  # rank 1 reads now
            dist.barrier(group=pg)
            del junk
            released = _released_soon()
            return [released, alive() is None]  # held until rank 1 had read, then let go
        dist.barrier(group=pg)
        total = rs.reduced()  # reads rank 0's chunk of each gradient; waits for rank 0's acknowledgement
        peer = [m - 1000 for m in mine]  # rank 0's values of the same chunk
        want = torch.cat([(a + b).flatten() for a, b in zip(mine, peer)])
        right = torch.equal(total, want)
        dist.barrier(group=pg)
        return [right, _released_soon()]


@pytest.mark.parametrize("pipes", [True, False], ids=["pipes", "gloo"])
def test_gradients_dropped_mid_reduce_scatter_stay_readable_until_the_peer_has_read(pipes):
    assert run_on_ranks(_gradients_dropped_mid_reduce_scatter, 2, pipes) == [[True, True], [True, True]]


def _released_means_unlisted(rounds: int) -> list[int]:
    """Leases over gloo, released by their waiter thread while this thread polls: each one
    found released must already be off the registry (``live()``) and hold nothing, thread
    switches forced often."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    seen_listed = 0
    try:
        with _reading_group(pipes=False) as pg:
            me = pg.rank()
            peer = 1 - me
            for _ in range(rounds):
                lease = _lease.Lease(pg, "a lease", ack_tag=77)
                lease.expect_ack(peer)
                lease.acknowledge(peer)
                while not lease.poll():
                    pass
                seen_listed += lease in _lease.live() or bool(lease.keep)  # listed, or its memory held
                _lease.drain(5.0)
    finally:
        sys.setswitchinterval(old)
    return [seen_listed]


def test_a_released_lease_is_off_the_registry_when_it_says_so():
    # A lease's waiter thread (gloo) once marked it done before taking it off the registry:
    # a poll in between saw "released" while live() still listed it (flaky drains in CI).
    assert run_on_ranks(_released_means_unlisted, 2, 300) == [[0], [0]]


def _released_with_a_waiter(rounds: int) -> list[int]:
    """Leases over gloo whose waiter thread started (a poll) before this thread's ``wait``:
    after the wait no waiter is left inside gloo. A gloo work waited on by both threads gave its
    one completion to one of them and left the other blocked until the connection closed, at
    interpreter exit: ``pthread_exit`` inside C++, SIGABRT (seen in CI)."""
    left = 0
    with _reading_group(pipes=False) as pg:
        peer = 1 - pg.rank()
        for _ in range(rounds):
            lease = _lease.Lease(pg, "a lease", ack_tag=78)
            lease.expect_ack(peer)
            lease.acknowledge(peer)
            lease.poll()  # starts the waiter thread
            lease.wait()
            left += lease.waiter.is_alive()
        _lease._drain_at_exit()  # and the exit hook leaves none either
        left += len(_lease.join_waiters(0.0))
        dist.barrier(group=pg)
    return [left]


def test_no_waiter_thread_is_left_in_gloo_after_a_lease_is_released():
    assert run_on_ranks(_released_with_a_waiter, 2, 50) == [[0], [0]]


def _training_leaves_nothing_held() -> list[int]:
    torch.manual_seed(0)
    model = MLP(256)
    with environ(CPU_COLLECTIVES_ENV, "read"):
        fsdp2.fully_shard(model)
    for _ in range(2):
        model(torch.randn(4, 256)).sum().backward()
    return [len(_lease.live()), len(_lease._orphans)]


def test_training_leaves_no_memory_held_for_peers():
    # Every lease is released by the runtime's own waits: none is left for the exit drain.
    assert run_on_ranks(_training_leaves_nothing_held, 2) == [[0, 0]] * 2


# ---- a rank that exits early ------------------------------------------------------------------

def _launch(scenario: str, launcher: str, tmp: Path) -> tuple[list[int | None], list[str], float]:
    """Run ``tests/comm/_exit_scenarios.py`` on two ranks: their exit codes, their stderr (subprocess
    only), and how long rank 0 took to exit once its main function had returned."""
    init, out = tmp / "init", str(tmp / "result")
    if launcher == "subprocess":  # as torchrun starts ranks: fresh interpreters
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        procs = [subprocess.Popen([sys.executable, "-m", "tests.comm._exit_scenarios", str(r), scenario,
                                   str(init), out], cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        errs = [procs[0].communicate(timeout=120)[1]]
        exited = time.time()
        errs.append(procs[1].communicate(timeout=120)[1])
        codes: list[int | None] = [p.returncode for p in procs]
    else:  # as mp.spawn starts ranks: multiprocessing children, which leave by os._exit
        from tests.comm import _exit_scenarios
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_exit_scenarios.main, args=(r, scenario, str(init), out)) for r in range(2)]
        for p in procs:
            p.start()
        procs[0].join(timeout=120)
        exited = time.time()
        procs[1].join(timeout=120)
        codes, errs = [p.exitcode for p in procs], ["", ""]
    left = os.path.getmtime(f"{out}.left") if os.path.exists(f"{out}.left") else float("-inf")
    return codes, errs, exited - left


def _results(tmp: Path) -> list[dict]:
    return [json.loads((tmp / f"result.rank{r}.json").read_text()) for r in range(2)]


EARLY_EXITS = [("exit", "subprocess"), ("exit", "multiprocessing"), ("peer_dies", "subprocess")]


@pytest.fixture(scope="module")
def early_exits(python_runs, tmp_path_factory) -> Iterator[dict[tuple[str, str], Future]]:
    """``_launch`` of every (scenario, launcher) of ``EARLY_EXITS``, started together, each in a
    thread and a directory of its own: an ``exit`` run spends most of its time with rank 1
    waiting up to 5 s for rank 0 to be gone, which is idle time the others can use (so do the
    interpreters of ``python_runs``, started first). The future of each gives its ``_launch``
    result and its directory (or raises its error)."""
    with ThreadPoolExecutor(len(EARLY_EXITS)) as pool:
        def launch(scenario: str, launcher: str) -> tuple[list[int | None], list[str], float, Path]:
            tmp = tmp_path_factory.mktemp(f"{scenario}-{launcher}")
            return (*_launch(scenario, launcher, tmp), tmp)

        yield {key: pool.submit(launch, *key) for key in EARLY_EXITS}


@pytest.mark.parametrize("launcher", ["subprocess", "multiprocessing"])
@pytest.mark.slow
def test_a_rank_that_exits_early_stays_readable_until_its_peer_has_read(launcher, early_exits):
    codes, errs, _, tmp = early_exits["exit", launcher].result()
    assert codes == [0, 0], errs
    rank0, rank1 = _results(tmp)
    assert rank0["right"] is True
    assert rank1 == {"pid": rank1["pid"], "right": True}, rank1  # no error: rank 0 was still there


@pytest.mark.slow
def test_a_rank_whose_peer_died_unread_exits_at_once_and_says_so(early_exits):
    codes, errs, took, _ = early_exits["peer_dies", "subprocess"].result()
    assert codes[0] == 0 and codes[1] == -9, errs
    assert took < _lease.EXIT_WAIT_S / 2, took  # did not wait for a peer that is gone
    assert ("exited without saying they had finished reading this process's memory" in errs[0]), errs[0]


# ---- reads check their places ---------------------------------------------------------------------

def test_reads_refuse_places_and_sources_that_are_not_contiguous():
    source = torch.arange(12, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"fsdp2: all_gather g: place 0 is not contiguous \(shape \(3, 2\), "
                                         r"stride \(1, 3\), cpu\): a same-host read moves one dense run"):
        _cma.read(_cma.describe([source[:6]]), [torch.empty(2, 3).t()], "all_gather g", pid=os.getpid())
    with pytest.raises(ValueError, match=r"fsdp2: describe: offered tensor 1 is not contiguous \(shape \(6,\), "
                                         r"stride \(2,\), cpu\).*pass a contiguous CPU tensor"):
        _cma.describe([source[:2], source[::2]])
    got = torch.empty(2, 3)
    _cma.read(_cma.describe([source[6:]]), [got], "all_gather g", pid=os.getpid())  # contiguous: read from this process
    assert torch.equal(got.flatten(), source[6:])
    with pytest.raises(RuntimeError, match=rf"fsdp2: all_gather g: the peer's descriptor names pid {os.getpid()}, "
                                           r"but the probe recorded no pid for it: refusing to read"):
        _cma.read(_cma.describe([source[6:]]), [got], "all_gather g", pid=None)


# ---- a descriptor names the pid the probe recorded ---------------------------------------------------

def _forged_descriptor(pipes: bool) -> list[object]:
    """Rank 1 offers rank 0 a descriptor naming rank 0's own pid and a tensor of rank 0's that
    was never offered (a confused deputy: the bytes would come from the wrong process). Rank 0
    must refuse it instead of copying its secret; rank 1 reads rank 0's honest offer as usual,
    and each side's memory is let go once the other has said it is done."""
    with _reading_group(pipes) as pg:
        me, peer = pg.rank(), 1 - pg.rank()
        secret, honest, got = torch.full((4,), 7.0), torch.full((4,), float(me)), torch.zeros(4)
        where = torch.tensor([os.getpid(), secret.data_ptr()], dtype=torch.int64)
        rows = [torch.empty_like(where) for _ in range(2)]
        dist.all_gather(rows, where, group=pg)
        descriptor = _cma.describe([honest])
        if me == 1:
            descriptor = torch.tensor([*rows[0].tolist(), secret.numel() * 4], dtype=torch.int64)
        tag = _exchange._tag_of_size("forged", "where", descriptor.numel() * 8)
        reads = _exchange.ReadExchange(_pipes.link(pg), "all_gather forged",
                                       _exchange._tag_of_size("forged", "ack", 24), pids=_cma.pids(pg))
        reads.expect(peer, descriptor.numel(), tag, [got])
        reads.offer(peer, descriptor, tag, [honest])
        if me == 1:
            reads.wait()  # reads rank 0's honest offer; then waits for rank 0 to say it is done
            return [got.tolist(), _released_soon()]
        try:
            reads.wait()
            said = "read"
        except RuntimeError as e:
            said = str(e)
        del reads  # dropped unread: rank 1 is told this rank never will read it
        gc.collect()
        return [said, got.tolist(), _released_soon()]


@pytest.mark.parametrize("pipes", [True, False], ids=["pipes", "gloo"])
def test_a_descriptor_naming_another_pid_is_refused(pipes):
    # Without the check, rank 0 copied its own secret (7.0) where rank 1's values belong.
    (said, got, released), rank1 = run_on_ranks(_forged_descriptor, 2, pipes)
    assert re.fullmatch(r"fsdp2: all_gather forged: the peer's descriptor names pid (\d+), but the probe "
                        r"recorded pid (\d+) for that peer: refusing to read another process's memory \(.*\)",
                        said), said
    assert got == [0.0] * 4 and released, (said, got, released)
    assert rank1 == [[0.0] * 4, True]


# ---- the probe reads only where the ranks share a host ----------------------------------------------

def _probe_with_a_peer_elsewhere() -> list[object]:
    """Rank 1's host key is made to differ (as on another host or in another PID namespace):
    no rank reads anything, every rank says no, and the log says why."""
    pg = dist.new_group()
    reads: list[int] = []
    real_read, real_host = _cma.read, _cma._host

    def counted(descriptor: torch.Tensor, *args: object, **kwargs: object) -> None:
        reads.append(int(descriptor[0]))
        real_read(descriptor, *args, **kwargs)

    try:
        with pytest.MonkeyPatch.context() as patch, info_records(_cma.logger) as records:
            patch.setattr(_cma, "read", counted)
            if pg.rank() == 1:
                patch.setattr(_cma, "_host", lambda: real_host() ^ 1)
            verdict = _cma.probe(pg)
        return [verdict, reads, [r.getMessage() for r in records]]
    finally:
        dist.destroy_process_group(pg)


def test_the_probe_reads_nothing_when_the_host_keys_differ():
    # Without the check, each rank read the pid in its peer's row: on another host, that pid
    # names some unrelated process of this one, or none.
    results = run_on_ranks(_probe_with_a_peer_elsewhere, 2)
    for me, (verdict, reads, said) in enumerate(results):
        assert verdict is False and reads == [], results
        assert said == [f"fsdp2: the ranks [0, 1] cannot read each other's memory with process_vm_readv (this "
                        f"rank is not on the host (or in the PID namespace, or the FSDP2_NODE node) of rank {1 - me}: "
                        "their host keys "
                        "differ); CPU exchanges over this process group send messages instead"], said


# ---- Yama ----------------------------------------------------------------------------------------

R = _yama.Rank


def test_yama_names_the_narrowest_process_covering_the_peers():
    assert _yama.tracer_for([R(200, 100)]) == 200  # one peer: itself
    assert _yama.tracer_for([R(201, 100), R(202, 100), R(203, 100)]) == 100  # siblings: their launcher
    assert _yama.tracer_for([R(300, 50), R(301, 300), R(302, 300)]) == 300  # one rank started the others
    assert _yama.tracer_for([R(201, 100), R(301, 300)]) is None  # started apart: no narrow choice
    assert _yama.tracer_for([R(201, 1), R(202, 1)]) is None  # pid 1's descendants are everything
    assert _yama.tracer_for([]) is None


def test_yama_scope_is_read_from_the_kernel():
    path = Path(_yama.SCOPE_PATH)
    assert _yama.scope() == (int(path.read_text()) if path.exists() else None)


_DECLARE = textwrap.dedent("""
    import os
    from fsdp2.comm.cpu import _yama
    first = _yama._declare(os.getppid())  # this process may be read by its parent and the parent's descendants
    print(repr(first), repr(_yama._declare(0)), _yama._declared)
""")


def _declare_in_a_child(tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _DECLARE], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=120)


@pytest.mark.slow
def test_the_declaration_reaches_the_kernel(python_runs, request):
    # Where Yama runs, prctl(PR_SET_PTRACER) takes the pid and 0 withdraws it; elsewhere the
    # kernel refuses the option, and the refusal is reported, not hidden.
    _, done = python_runs[request.node.originalname].result()
    assert done.returncode == 0, done.stderr
    if _yama.scope() is None:
        assert re.fullmatch(r"'prctl\(PR_SET_PTRACER, \d+\) failed: Invalid argument' '' 0\n", done.stdout), done.stdout
    else:
        assert done.stdout == "'' '' 0\n", done.stdout


def _allowed_here() -> list[object]:
    """On this host: nothing to declare without Yama or with ptrace_scope=0; reads work."""
    pg = dist.new_group()
    try:
        ok = probe_reads(pg)
        return [ok, _yama._declared, _yama.scope() in (None, 0) or _yama._declared != 0]
    finally:
        dist.destroy_process_group(pg)


def test_the_probe_lets_the_peers_in_only_where_yama_asks():
    results = run_on_ranks(_allowed_here, 2)
    if _yama.scope() in (None, 0):
        assert results == [[True, 0, True]] * 2  # nothing declared: Linux's own rule lets them read
    else:  # ptrace_scope=1: each rank named its one peer
        assert all(r[2] for r in results), results


def _declarations_as_groups_are_destroyed(tmp: str) -> list[object]:
    """Under Yama's ``ptrace_scope=1`` (a file saying 1 stands in for the kernel's, and the
    prctl is recorded, as this machine has no Yama): two groups read over, both needing the
    one peer. Destroying the first leaves the declaration; destroying the last withdraws it
    at once, with no probe or read exchange after it."""
    calls: list[int] = []
    scope = Path(tmp) / f"ptrace_scope.{dist.get_rank()}"
    scope.write_text("1\n")
    seen = []
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_yama, "SCOPE_PATH", str(scope))
            patch.setattr(_yama, "_set_ptracer", lambda tracer: calls.append(tracer) or "")
            first, second = dist.new_group(), dist.new_group()
            assert _cma.probe(first) and _cma.probe(second)
            peer = _cma.pids(first)[1 - first.rank()]
            seen.append(_yama._declared)
            dist.destroy_process_group(first)
            seen.append(_yama._declared)
            dist.destroy_process_group(second)
            seen.append(_yama._declared)
        return [[pid == peer for pid in seen], calls == [peer, 0], calls.count(0)]
    finally:  # whatever happened: this process declares nothing (the real prctl is back)
        _yama._needs.clear()
        _yama._declared = 0


def test_the_declaration_is_withdrawn_when_the_last_group_reading_is_destroyed(tmp_path):
    # Before: withdrawn only at the next probe of some other group, if any ever came.
    for flags in run_on_ranks(_declarations_as_groups_are_destroyed, 2, str(tmp_path)):
        assert flags == [[True, True, False], True, 1], flags


# ---- no fcntl, no reads --------------------------------------------------------------------------

_WITHOUT_FCNTL = textwrap.dedent("""
    import sys
    sys.modules["fcntl"] = None  # as on a platform without it: importing it raises ImportError
    import torch, torch.distributed as dist
    import fsdp2
    from tests._models import MLP
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    torch.manual_seed(0)
    model, reference = MLP(64), MLP(64)
    reference.load_state_dict(model.state_dict())
    fsdp2.fully_shard(model)
    x = torch.randn(4, 64)
    model(x).sum().backward()
    reference(x).sum().backward()
    same = all(torch.allclose(p.grad.full_tensor(), r.grad) for p, r in zip(model.parameters(), reference.parameters()))
    print("fcntl" in sys.modules and sys.modules["fcntl"] is None, same)
    dist.destroy_process_group()
""")


def _train_without_fcntl(tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WITHOUT_FCNTL, str(tmp / "init")], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
                          timeout=300)


# The fresh interpreter of each test named below, started together (tests/_together.py), and
# with ``early_exits`` where that runs: test -> the future of (its directory, the finished process).
python_runs = launched_together({
    "test_the_declaration_reaches_the_kernel": _declare_in_a_child,
    "test_fsdp2_imports_and_trains_without_fcntl": _train_without_fcntl,
})


@pytest.mark.slow
def test_fsdp2_imports_and_trains_without_fcntl(python_runs, request):
    _, done = python_runs[request.node.originalname].result()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"], done.stdout + done.stderr
