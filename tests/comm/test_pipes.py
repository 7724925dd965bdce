"""The read exchanges' small messages over named pipes (``fsdp2/comm/cpu/_pipes.py``).

Ranks on one host that read each other's memory also connect by pipes, and the
headers, descriptors and acknowledgements of their exchanges go there instead of
through gloo. The pipes must match messages as gloo does (peer and tag, in posting
order), never deadlock, time out like the process group, fail at once when the peer is
gone, fall back to gloo on every rank alike, and leave no file descriptors behind.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fsdp2
from fsdp2.comm.cpu import _exchange, _pipes
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from fsdp2.comm.cpu._transport import probe_reads
from fsdp2.runtime._state import get_state
from tests._dist import environ, info_records, run_on_ranks
from tests._models import MLP
from tests._parity import assert_grads_are_average


@contextlib.contextmanager
def _connected(timeout_s: float = 60.0, pipes: bool = True) -> Iterator[dist.ProcessGroup]:
    """A new process group over every rank, probed and (unless ``pipes`` is off) connected."""
    pg = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    try:
        with environ(_pipes.PIPES_ENV, "1" if pipes else "0"):
            assert probe_reads(pg)
        yield pg
    finally:
        dist.destroy_process_group(pg)


def _open_pipes() -> int:
    """This process's open fsdp2 pipes (removed from disk once open: ".../fsdp2-pipes-.../from-1 (deleted)")."""
    fds = "/proc/self/fd"
    return sum("fsdp2-pipes-" in os.readlink(os.path.join(fds, fd)) for fd in os.listdir(fds)
               if os.path.exists(os.path.join(fds, fd)))


def _ints(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _messages_in_order() -> list[list[int]]:
    """Three messages on one tag and one on another, received out of order; then 3 MiB each
    way, sent by both ranks before either receives (more than a pipe holds)."""
    with _connected() as pg:
        pipes = _pipes.link(pg)
        assert isinstance(pipes, _pipes.Pipes)
        me, peer = pg.rank(), 1 - pg.rank()
        got = [torch.zeros(2, dtype=torch.int64) for _ in range(4)]
        works = [pipes.recv([got[0]], peer, 7), pipes.recv([got[1]], peer, 7), pipes.recv([got[2]], peer, 9),
                 pipes.recv([got[3]], peer, 7)]
        for n, tag in enumerate((9, 7, 7, 7)):
            pipes.send([_ints(me, 100 * tag + n)], peer, tag).wait()
        for i in (3, 2, 0, 1):  # later receives first: each still gets its own message
            works[i].wait()
        big = torch.full((3 << 18,), float(me))  # 3 MiB of float32
        pipes.send([big], peer, 11)
        theirs = torch.empty_like(big)
        pipes.recv([theirs], peer, 11).wait()
        assert torch.equal(theirs, torch.full_like(big, float(peer)))
        return [t.tolist() for t in got]


def test_messages_match_by_peer_and_tag_in_posting_order():
    results = run_on_ranks(_messages_in_order, 2)
    for me, got in enumerate(results):
        peer = 1 - me
        assert got == [[peer, 701], [peer, 702], [peer, 900], [peer, 703]]


def _wait_for_what_never_comes() -> list[str]:
    """Rank 0 waits for a message rank 1 never sends: the group's timeout (1 s), then at once."""
    with _connected(timeout_s=1.0) as pg:
        said = []
        if pg.rank() == 0:
            pipes = _pipes.link(pg)
            for _ in range(2):
                with pytest.raises(RuntimeError) as info:
                    pipes.recv([torch.zeros(1)], 1, 5).wait()
                said.append(str(info.value))
        dist.barrier()  # (the default group) rank 1 keeps its end open until rank 0 is done
        return said


def test_a_wait_times_out_with_the_groups_timeout_then_fails_at_once():
    said = run_on_ranks(_wait_for_what_never_comes, 2)
    assert said[1] == []
    assert said[0] == [
        "fsdp2: Timed out waiting 1000ms to receive from rank 1 (the same-host pipe of the read exchanges)",
        "fsdp2: no message can come from rank 1 any more: timed out after 1000ms",
    ]


def _peer_closes_its_pipes() -> str:
    """Rank 1 sends one message and closes its pipes (as when it exits): rank 0 gets that
    message, then its next wait fails at once instead of waiting out the 10-minute timeout."""
    with _connected(timeout_s=600.0) as pg:
        pipes = _pipes.link(pg)
        said = ""
        if pg.rank() == 1:
            pipes.send([_ints(42)], 0, 3)
            pipes.close()
        else:
            first, second = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
            works = [pipes.recv([first], 1, 3), pipes.recv([second], 1, 3)]
            works[0].wait()
            assert first.item() == 42
            with pytest.raises(RuntimeError) as info:
                works[1].wait()
            said = str(info.value)
        dist.barrier()
        return said


def test_a_closed_pipe_fails_the_wait_at_once():
    said = run_on_ranks(_peer_closes_its_pipes, 2, timeout=60)
    assert said == ["fsdp2: no message can come from rank 1 any more: rank 1 closed its end of the pipe "
                    "(it exited)", ""]


def _a_frame_that_cannot_be_fsdp2s(size: int) -> list[object]:
    """Rank 1 sends one good message, then writes a frame saying ``size`` bytes straight into
    its pipe to rank 0 (a stream out of step, or a writer that is not fsdp2). Rank 0 gets the
    good message; its wait for the next fails at once, saying what arrived (it spun forever on
    a size of -16, and waited out the 10-minute timeout on a huge one), and so does every
    later wait on rank 1."""
    with _connected(timeout_s=600.0) as pg:
        pipes = _pipes.link(pg)
        said: list[object] = []
        if pg.rank() == 1:
            pipes.send([_ints(42)], 0, 3)
            os.write(pipes.peers[0].out, _pipes._FRAME.pack(3, size) + bytes(64))
        else:
            first = torch.zeros(1, dtype=torch.int64)
            works = [pipes.recv([first], 1, 3), pipes.recv([torch.zeros(1, dtype=torch.int64)], 1, 3),
                     pipes.recv([torch.zeros(1, dtype=torch.int64)], 1, 4)]
            works[0].wait()
            said.append(first.item())
            for work in works[1:]:
                with pytest.raises(RuntimeError) as info:
                    work.wait()
                said.append(str(info.value))
        dist.barrier()  # (the default group) rank 1 keeps its end open until rank 0 is done
        return said


@pytest.mark.parametrize("size", [-16, -1, _pipes.MAX_FRAME + 1, 1 << 62])
def test_a_frame_with_a_negative_or_oversized_length_is_an_error(size):
    said = run_on_ranks(_a_frame_that_cannot_be_fsdp2s, 2, size, timeout=60)
    why = (f"rank 1 sent a pipe frame of {size} bytes (tag 3), where a frame holds 0 to {_pipes.MAX_FRAME}: its "
           "stream is corrupt (out of step, or not written by fsdp2)")
    assert said == [[42, *[f"fsdp2: no message can come from rank 1 any more: {why}"] * 2], []]


def _oversized_send() -> str:
    with _connected() as pg:
        with pytest.raises(ValueError) as info:
            _pipes.link(pg).send([torch.empty(_pipes.MAX_FRAME + 1, dtype=torch.uint8)], 1 - pg.rank(), 5)
        return str(info.value)


def test_a_message_too_big_for_a_frame_is_refused_before_it_is_sent():
    said = run_on_ranks(_oversized_send, 2)
    assert said == [f"fsdp2: a pipe message holds at most {_pipes.MAX_FRAME} bytes, not {_pipes.MAX_FRAME + 1} "
                    "(tag 5): send it over the process group"] * 2


def _connect_with_one_rank_unable(env: str) -> list[object]:
    """Rank 1 cannot make its pipes (its temporary directory does not exist), or pipes are off:
    every rank keeps gloo, and says why in fsdp2's log (INFO) when it wanted pipes."""
    saved = tempfile.tempdir
    if dist.get_rank() == 1:
        tempfile.tempdir = "/nonexistent/fsdp2"
    try:
        with info_records(_pipes.logger) as records, environ(_pipes.PIPES_ENV, env), \
                _connected(pipes=env != "0") as pg:
            on_gloo = _pipes.link(pg) is pg
        return [on_gloo, *(r.getMessage() for r in records)]
    finally:
        tempfile.tempdir = saved


def test_ranks_keep_gloo_alike_when_one_cannot_make_pipes():
    results = run_on_ranks(_connect_with_one_rank_unable, 2, "1")
    assert results[0] == [True, "fsdp2: the ranks [0, 1] read each other's memory but send its messages over "
                                "gloo (rank 1 could not make its pipes)"]
    assert results[1][0] is True
    assert results[1][1].startswith("fsdp2: the ranks [0, 1] read each other's memory but send its messages "
                                    "over gloo (making the pipes: [Errno 2] No such file or directory")
    assert run_on_ranks(_connect_with_one_rank_unable, 2, "0") == [[True], [True]]  # off: nothing to say


def _train_on_a_fresh_group(pipes: bool) -> str:
    """A read exchange's messages go where the group's connection says; training is right either way."""
    with _connected(pipes=pipes) as pg:
        mesh = DeviceMesh.from_group(pg, "cpu", mesh_dim_names=(f"pipes_{pg.group_name}",))
        torch.manual_seed(0)
        model, reference = MLP(256), MLP(256)
        reference.load_state_dict(model.state_dict())
        with environ(CPU_COLLECTIVES_ENV, "read"):
            fsdp2.fully_shard(model, mesh=mesh)
        group = get_state(model).group
        model.unshard(async_op=True)
        reads = group._gather.exchange.exchange
        assert isinstance(reads, _exchange.ReadExchange)
        link = type(reads.pg).__name__
        model.reshard()
        for step in range(2):
            x = torch.randn(4, 256, generator=torch.Generator().manual_seed(10 * dist.get_rank() + step))
            model(x).sum().backward()
            reference(x).sum().backward()
            assert_grads_are_average(reference, model)
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
        del model, group, reads
        return link


@pytest.mark.parametrize("pipes", [True, False])
def test_read_exchanges_train_to_the_reference_with_messages_on_pipes_or_gloo(pipes):
    want = "Pipes" if pipes else "ProcessGroup"
    assert run_on_ranks(_train_on_a_fresh_group, 2, pipes) == [want, want]


def _pipes_open_while_groups_come_and_go() -> list[int]:
    """Each connected group holds two pipes per peer; a destroyed group's are closed at the
    next connect, so connecting groups one after another does not pile them up."""
    with _connected():
        pass  # closes the pipes of groups earlier tests destroyed
    counts = []
    for _ in range(3):
        with _connected():
            counts.append(_open_pipes())
    return counts


def test_pipes_of_destroyed_groups_are_closed():
    per_group = 2 * 3  # 4 ranks: two pipes with each of 3 peers
    for counts in run_on_ranks(_pipes_open_while_groups_come_and_go, 4):
        # The same count each time (groups earlier tests keep hold pipes too): kept, a
        # destroyed group's pipes would add 6 per round.
        assert counts[0] >= per_group and counts == [counts[0]] * 3, counts


def _a_forked_child_closes_its_copies() -> list[int]:
    """A fork (a data-loader worker) must not keep the pipes open: its copies of the write
    ends would hide a dead rank from its peers. Counts in the child, then in the parent."""
    with _connected() as pg:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report and leave at once (no cleanup of the parent's state)
            os.write(write_end, bytes([min(_open_pipes(), 255), int(_pipes.link(pg) is pg)]))
            os._exit(0)
        os.waitpid(pid, 0)
        child = list(os.read(read_end, 2))
        os.close(read_end)
        os.close(write_end)
        return [*child, int(_open_pipes() >= 2)]


def test_a_forked_child_closes_its_copies_of_the_pipes():
    assert run_on_ranks(_a_forked_child_closes_its_copies, 2) == [[0, 1, 1]] * 2
