"""The transports: exchanges by reads or messages (CPU) and flat collectives (NCCL's path).

On CPU fsdp2 moves the parameters and gradients of groups of 1 MiB and more point to point,
straight into and out of the unsharded buffers (``fsdp2/comm/cpu/_exchange.py``): ranks on one host
read each other's memory (``fsdp2/comm/cpu/_cma.py``), others send ``isend``/``irecv`` messages;
smaller CPU groups and GPUs use flat ``all_gather_into_tensor``/``reduce_scatter_tensor``
collectives. ``FSDP2_CPU_COLLECTIVES=read`` / ``exchange`` / ``flat`` puts every CPU group on
one path, so all are tested here whatever the model's size, the code NCCL runs included: the
layouts that exercise every branch of both (uneven and dim-1 shards, mixed dtypes, mixed
precision with a reduce-dtype cast, int ``reshard_after_forward``, HSDP, tensor parallelism)
must train to the unsharded reference either way.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2
from fsdp2.comm.cpu import _cma, _exchange
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV, EXCHANGE_MIN_BYTES
from fsdp2.comm.cpu._transport import probe_reads
from fsdp2.runtime._state import get_state
from tests.parallel import test_2d
from tests.runtime import test_mixed_precision, test_parity
from tests._dist import environ, info_records, run_on_ranks
from tests._parity import assert_grads_are_average
from tests._models import MLP


def _under(transport: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` with CPU groups built on ``transport``."""
    with environ(CPU_COLLECTIVES_ENV, transport):
        return fn(*args)


def _transport_of_a_new_group(transport: str, dim: int) -> bool:
    model = MLP(dim)  # dim x 4 dim twice, fp32: 32 dim^2 bytes
    _under(transport, fsdp2.fully_shard, model)
    return get_state(model).group.transport.gathers_in_place


def test_environment_variable_picks_the_cpu_transport():
    # auto (the default): exchanges from EXCHANGE_MIN_BYTES (1 MiB) of unsharded parameters.
    assert EXCHANGE_MIN_BYTES == 2**20
    assert run_on_ranks(_transport_of_a_new_group, 2, "auto", 8) == [False, False]  # 2 KiB
    assert run_on_ranks(_transport_of_a_new_group, 2, "auto", 256) == [True, True]  # 2 MiB
    assert run_on_ranks(_transport_of_a_new_group, 2, "exchange", 8) == [True, True]
    assert run_on_ranks(_transport_of_a_new_group, 2, "read", 8) == [True, True]
    assert run_on_ranks(_transport_of_a_new_group, 2, "flat", 256) == [False, False]


def _bad_transport() -> str:
    with pytest.raises(ValueError, match=r"FSDP2_CPU_COLLECTIVES='nccl': use 'auto' \(the default\), "
                                         r"'read', 'exchange' or 'flat'"):
        _under("nccl", fsdp2.fully_shard, MLP(8))
    return "ok"


def test_unknown_transport_is_refused():
    assert run_on_ranks(_bad_transport, 2) == ["ok", "ok"]


LAYOUTS = {  # (rank function, world size, its arguments)
    "blocks_then_root": (test_parity._transformer_bottom_up, 2, ()),
    "uneven_dim0": (test_parity._uneven, 4, ()),
    "dim1_uneven": (test_parity._placement_uneven, 2, ()),
    "mixed_dtypes": (test_parity._mixed_dtypes, 2, ()),
    "int_reshard": (test_parity._reshard_after_forward, 4, (2, 1e-4)),
    "bf16_fp32_reduce": (test_mixed_precision._train_side_by_side,
                         2, ({"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},)),
    "hsdp": (test_2d._hsdp_parity, 4, (False,)),
    "tp": (test_2d._tp_parity, 4, ()),
}


@pytest.mark.parametrize("transport", ["read", "exchange", "flat"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.slow
def test_both_transports_train_to_the_reference(layout, transport):
    fn, world, args = LAYOUTS[layout]
    results = run_on_ranks(_under, world, transport, fn, *args)
    if layout == "bf16_fp32_reduce":  # trained next to torch's fully_shard: the same numbers
        test_mixed_precision._check_matches_torch(results[0], torch.bfloat16)


def _user_traffic_beside_fsdp2(transport: str) -> list[float]:
    """Point-to-point messages of the user's (tag 0) cross fsdp2's exchanges in flight."""
    return _under(transport, _user_traffic)


def _user_traffic() -> list[float]:
    torch.manual_seed(0)
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    model = nn.Sequential(MLP(16), MLP(16))
    reference = [p.detach().clone() for p in model.parameters()]
    for block in model:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    handle = model[1].unshard(async_op=True)  # an all-gather in flight ...
    mine = torch.full((1000,), float(rank))
    theirs = torch.empty(1000)
    works = [dist.isend(mine, peer), dist.irecv(theirs, peer)]  # ... and the user's messages
    handle.wait()
    for w in works:
        w.wait()
    assert torch.equal(theirs, torch.full((1000,), float(peer)))
    for got, want in zip(model[1].parameters(), reference[len(reference) // 2:]):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
    model[1].reshard()
    # A backward whose reduce-scatters are in flight while the user exchanges again.
    loss = model(torch.ones(4, 16) * (rank + 1)).sum()
    loss.backward()
    works = [dist.isend(mine + 1, peer), dist.irecv(theirs, peer)]
    for w in works:
        w.wait()
    assert torch.equal(theirs, torch.full((1000,), float(peer + 1)))
    return [p.grad.full_tensor().sum().item() for p in model.parameters()]


@pytest.mark.parametrize("transport", ["read", "exchange"])
def test_user_point_to_point_messages_do_not_mix_with_fsdp2s(transport):
    grads = run_on_ranks(_user_traffic_beside_fsdp2, 2, transport)
    assert grads[0] == grads[1]  # averaged over both ranks: the same everywhere


# ---- reads (same host) ------------------------------------------------------------------
@contextlib.contextmanager
def _reduce_scatter_kinds() -> Iterator[list[str]]:
    """The kinds of exchange (``ReadExchange``, ``Exchange``) of the reduce-scatters issued
    inside; the real ones run."""
    kinds: list[str] = []
    original = _exchange.start_reduce_scatter

    def spy(*args, **kwargs):
        rs = original(*args, **kwargs)
        kinds.append(type(rs.exchange).__name__)
        return rs

    _exchange.start_reduce_scatter = spy
    try:
        yield kinds
    finally:
        _exchange.start_reduce_scatter = original


def _how_a_big_group_moves(transport: str) -> tuple[str, str, bool]:
    """(all-gather's kind, reduce-scatter's kind, parameters right) for a 2 MiB group."""
    torch.manual_seed(0)
    model = MLP(256)
    full = [p.detach().clone() for p in model.parameters()]
    _under(transport, fsdp2.fully_shard, model)
    group = get_state(model).group
    model.unshard(async_op=True)  # probes the transport (once per process group), then gathers
    gather_kind = type(group._gather.exchange.exchange).__name__
    model.unshard()
    right = all(torch.equal(p.detach(), f) for p, f in zip(model.parameters(), full))
    model.reshard()
    with _reduce_scatter_kinds() as kinds:
        model(torch.randn(4, 256)).sum().backward()
    return gather_kind, kinds[0], right


def test_ranks_on_one_host_read_each_other():
    # The default picks reads on this machine (one host); "exchange" keeps messages.
    assert run_on_ranks(_how_a_big_group_moves, 2, "auto") == [("ReadExchange", "ReadExchange", True)] * 2
    assert run_on_ranks(_how_a_big_group_moves, 2, "exchange") == [("Exchange", "Exchange", True)] * 2


def _a_fresh_group_probes_at_its_first_gather() -> list[object]:
    """A group on a process group never probed finds out at its first all-gather, here a
    forward's (lazy init does not probe): its reduce-scatter reads, and training is right."""
    from torch.distributed.device_mesh import DeviceMesh

    pg = dist.new_group([0, 1])  # never probed
    # An axis name of its own: DTensor's caches must not hand this (destroyed) group's mesh to
    # an equal mesh of a later test.
    mesh = DeviceMesh.from_group(pg, "cpu", mesh_dim_names=(f"probe_{pg.group_name}",))
    torch.manual_seed(0)
    model = MLP(256)
    reference = MLP(256)
    reference.load_state_dict(model.state_dict())
    with environ(CPU_COLLECTIVES_ENV, "auto"):
        fsdp2.fully_shard(model, mesh=mesh)
    group = get_state(model).group
    before = (group._probed, _cma.usable(pg))
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(dist.get_rank()))
    with _reduce_scatter_kinds() as kinds:
        model(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_are_average(reference, model)
    after = (group._probed, _cma.usable(pg))
    del model, group
    dist.destroy_process_group(pg)
    return [before, after, kinds[0]]


def test_a_group_probes_reads_at_its_first_all_gather():
    assert run_on_ranks(_a_fresh_group_probes_at_its_first_gather, 2) == [
        [(False, False), (True, True), "ReadExchange"]] * 2


def _one_rank_runs_ahead() -> list[bool]:
    """Rank 1 reads rank 0's chunks only after rank 0 has finished its own wait.

    A read all-gather's wait returns once this rank has read its peers; that the peers
    have read this rank is waited for at the free of the unsharded buffer. (Were it part
    of the wait, rank 0 would wait for rank 1, which waits for rank 0's message: a hang.)
    """
    torch.manual_seed(0)
    model = MLP(256)
    full = [p.detach().clone() for p in model.parameters()]
    _under("read", fsdp2.fully_shard, model)
    group = get_state(model).group
    model.unshard(async_op=True)  # probes the transport (once per process group), then gathers
    assert isinstance(group._gather.exchange.exchange, _exchange.ReadExchange)
    signal = torch.zeros(1)
    if dist.get_rank() == 0:
        model.unshard()  # reads rank 1's chunks; rank 1 has not read rank 0's yet
        pending = group._unreleased is not None
        dist.send(signal, 1)
    else:
        dist.recv(signal, 0)
        model.unshard()
        pending = group._unreleased is not None
    right = all(torch.equal(p.detach(), f) for p, f in zip(model.parameters(), full))
    model.reshard()  # waits until the peer has read this rank's chunks, then frees
    return [pending, right, group._unreleased is None]


def test_a_rank_may_run_ahead_of_the_peers_reading_from_it():
    assert run_on_ranks(_one_rank_runs_ahead, 2) == [[True, True, True]] * 2


def _probe_with_one_rank_unable(transport: str) -> str:
    """Rank 1 has no process_vm_readv: every rank must fall back (or, forced, raise) alike,
    and say so in fsdp2's log (INFO)."""
    pg = dist.new_group([0, 1])  # a group never probed before
    saved = _cma._readv
    if dist.get_rank() == 1:
        _cma._readv = False
    try:
        with info_records(_cma.logger) as records, environ(CPU_COLLECTIVES_ENV, transport):
            try:
                verdict = f"reads={probe_reads(pg)}"
            except RuntimeError as e:
                return str(e)
        return verdict + "".join(f" | {r.levelname}: {r.getMessage()}" for r in records)
    finally:
        _cma._readv = saved
        dist.destroy_process_group(pg)


def test_ranks_agree_when_one_cannot_read():
    said = ("reads=False | INFO: fsdp2: the ranks [0, 1] cannot read each other's memory with process_vm_readv "
            "({}); CPU exchanges over this process group send messages instead")
    assert run_on_ranks(_probe_with_one_rank_unable, 2, "auto") == [said.format("rank 1 has no process_vm_readv"),
                                                                      said.format("this rank has no process_vm_readv")]
    errors = run_on_ranks(_probe_with_one_rank_unable, 2, "read")
    assert errors[0] == errors[1]
    assert errors[0].startswith("FSDP2_CPU_COLLECTIVES=read: the ranks [0, 1] cannot read each other's memory")
    assert "use 'auto' to fall back to messages" in errors[0]


def _read_mismatched_sizes() -> str:
    peer = torch.arange(6, dtype=torch.float32)
    with pytest.raises(RuntimeError) as info:
        _cma.read(_cma.describe([peer]), [torch.empty(4)], "all_gather layers.0", pid=os.getpid())
    got = torch.empty(6)
    _cma.read(_cma.describe([peer]), [got], "all_gather layers.0", pid=os.getpid())  # from this process: a copy
    assert torch.equal(got, peer)
    return str(info.value)


@pytest.mark.slow  # among the quick suite's longest (CI runs it on torch 2.13)
def test_a_read_checks_the_sizes_it_is_offered():
    message = run_on_ranks(_read_mismatched_sizes, 1)[0]
    assert message.startswith("fsdp2: all_gather layers.0: the peer (pid ")
    assert message.endswith("offers 1 regions of [24] bytes where this rank expects [16]: "
                            "the ranks disagree on what they exchange")
