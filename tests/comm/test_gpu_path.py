"""The CUDA path's hazards, fixed by construction: the parts of the logic that run on CPU too.

The CUDA side of each is in ``tests/comm/test_cuda.py`` (skipped without a GPU). Here, on gloo:

* an explicit ``unshard(async_op=True)`` sends a copy of the shards, taken at issue time,
  so an in-place change before the wait (``optimizer.step()``) cannot reach the collective;
  on an accelerator the flat all-gather never sends the shards themselves;
* a :class:`Completion` can be waited on by any number of waiters;
* one subgroup (one process group) per (mesh, k) for an int ``reshard_after_forward``;
* HSDP with the all-reduce off (gradient accumulation): the partial sums a later reduction
  adds in are among what its all-reduce stage keeps (``ReducedGrads.keep``), which CUDA holds
  until the compute stream has waited on that stage; on CPU nothing is left outstanding.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from fsdp2.comm._flat import send_aliases_shards
from fsdp2.comm._streams import Completion
from tests._dist import environ, run_on_ranks
from tests._models import Transformer, lm_loss, make_batch


def test_accelerators_never_send_the_shards_themselves():
    for explicit in (False, True):
        assert not send_aliases_shards(torch.device("cuda", 0), explicit)
    # The CPU sends the packed shards unless the user's unshard asked (meta: the memory planner's
    # groups, which play a CPU run).
    for device in ("cpu", "meta"):
        assert send_aliases_shards(torch.device(device), explicit=False)
        assert not send_aliases_shards(torch.device(device), explicit=True)


def _explicit_async_unshard_snapshots_the_shards() -> list[bool]:
    torch.manual_seed(0)
    with environ(CPU_COLLECTIVES_ENV, "flat"):
        model = Transformer()
        for block in model.layers:
            fsdp2.fully_shard(block)
        fsdp2.fully_shard(model)
    block = model.layers[1]
    group = block._fsdp_state().group
    weight = block.qkv.weight
    expected = weight.full_tensor().clone()
    # The schedule's own unshard sends the packed shards as they are (CPU: no copy-in)...
    group.unshard(async_op=True)
    aliased_internal = group._gather.send.data_ptr() == group._packed.data_ptr()
    group.reshard()
    # ...the user's async unshard sends a copy: an optimizer step before the wait cannot reach it.
    handle = block.unshard(async_op=True)
    sent = group._gather.send
    aliased_explicit = sent.data_ptr() == group._packed.data_ptr()
    with torch.no_grad():
        weight.to_local().add_(1000.0)  # what optimizer.step() does to the shard, in place
    handle.wait()
    gathered = block.qkv.weight.detach().clone()
    block.reshard()
    return [aliased_internal, aliased_explicit, torch.equal(gathered, expected),
            torch.equal(weight.full_tensor(), expected + 1000.0)]


def test_explicit_async_unshard_gathers_the_values_at_issue_time():
    for aliased_internal, aliased_explicit, gathered_at_issue, step_kept in run_on_ranks(
            _explicit_async_unshard_snapshots_the_shards, 2):
        assert aliased_internal, "the schedule's CPU unshard should send the packed shards (no copy-in)"
        assert not aliased_explicit, "an explicit async unshard must not send the parameters' own storage"
        assert gathered_at_issue, "the all-gather saw an in-place change made after it was issued"
        assert step_kept, "the in-place change to the shard was lost"


def _completion_with_many_waiters() -> list[float]:
    t = torch.full((1 << 16,), float(dist.get_rank() + 1))
    done = Completion(work=dist.all_reduce(t, async_op=True))
    assert done.pending
    seen: list[float] = []

    def waiter() -> None:
        done.wait()
        seen.append(float(t[-1]))

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    done.wait()  # and again on this thread: returns at once
    assert not done.pending
    seen.append(float(t[0]))
    return seen


def test_completion_orders_every_waiter_after_the_work():
    world_sum = 1.0 + 2.0
    for seen in run_on_ranks(_completion_with_many_waiters, 2):
        assert seen == [world_sum] * 4, seen


def _subgroups_per_mesh_and_k() -> list[bool]:
    c10d = dist.distributed_c10d
    created = []
    original = c10d.new_group

    def counting_new_group(*args, **kwargs):  # the real function, only counted
        created.append(kwargs.get("ranks", args[0] if args else None))
        return original(*args, **kwargs)

    # A mesh on a process group of its own: no earlier test on this pool has subgroups for it.
    mesh = DeviceMesh.from_group(dist.new_group(list(range(dist.get_world_size()))), "cpu")
    c10d.new_group = counting_new_group
    try:
        torch.manual_seed(0)
        model = Transformer(n_layers=4)
        for block in model.layers:
            fsdp2.fully_shard(block, mesh=mesh, reshard_after_forward=2)
        fsdp2.fully_shard(model, mesh=mesh, reshard_after_forward=2)
        after_k2 = len(created)
        groups = {id(m._fsdp_state().group.subgroup.group) for m in (*model.layers, model)}
        other = Transformer()
        for block in other.layers:
            fsdp2.fully_shard(block, mesh=mesh, reshard_after_forward=2)  # same mesh and k: same group
        same_again = len(created) == after_k2
        shared = (other.layers[0]._fsdp_state().group.subgroup.group
                  is model.layers[0]._fsdp_state().group.subgroup.group)
    finally:
        c10d.new_group = original
    # The cached subgroups train as before: forward, backward (resharding to pairs in between).
    x, y = make_batch(dist.get_rank(), 0)
    lm_loss(model(x), y).backward()
    grads_ok = all(p.grad is not None and torch.isfinite(p.grad.full_tensor()).all() for p in model.parameters())
    return [after_k2 == 2, len(groups) == 1, same_again, shared, grads_ok]


@pytest.mark.slow  # among the quick suite's longest (CI runs it on torch 2.13)
def test_one_subgroup_per_mesh_and_k():
    # 4 ranks in blocks of 2: new_subgroups_by_enumeration creates 2 groups (every rank creates
    # every block's), once for the first fully_shard call with k=2, never again.
    for flags in run_on_ranks(_subgroups_per_mesh_and_k, 4):
        assert flags == [True] * 5, flags


def _partial_sums_kept_by_the_stage_that_reads_them() -> list[object]:
    """Two reductions of one HSDP group (2 replicas of 1 shard) on gloo: the first with the
    all-reduce off, the second with it on, as a step of gradient accumulation runs them."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2.runtime._state import get_state
    from fsdp2.comm._collectives import ReduceTarget
    from fsdp2.comm._transport import flat_transport
    from fsdp2.runtime._reduction import Reduction, finish_reduction

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("partial_rep", "partial_shard"))
    model = fsdp2.fully_shard(torch.nn.Linear(8, 4), mesh=mesh)
    params = list(get_state(model).group.params)
    target = ReduceTarget(group=mesh.get_group(1), world=1, replicate_group=mesh.get_group(0), replicate_world=2,
                          all_reduce=False, partial={}, divide_factor=2.0, label="partial")

    def reduce(value: float):
        grads = [torch.full(p.layout.padded_shape, value) for p in params]
        inflight = flat_transport().start_reduce_scatter([p.layout for p in params], grads, torch.float32, target,
                                                         torch.device("cpu"), None)
        return finish_reduction(Reduction(inflight, tuple(params)))

    first = reduce(1.0)  # all-reduce off: the sum waits in target.partial
    kept = target.partial[torch.float32]
    target.all_reduce = True
    second = reduce(2.0 + dist.get_rank())  # adds the kept sum in, then averages over the replicas
    return [first.keep == (kept,), len(second.keep) == 2 and second.keep[1] is kept,
            first.outstanding or second.outstanding, target.partial == {},
            [p.grad.to_local().unique().tolist() for p in model.parameters()]]


def test_partial_sums_of_accumulation_are_kept_by_the_stage_that_adds_them():
    # On CUDA the stage's stream adds the partial sum in after the host moved on: had the sum
    # been dropped there (it was), the next reduce-scatter could reuse its memory first.
    for kept_first, kept_second, outstanding, emptied, grads in run_on_ranks(
            _partial_sums_kept_by_the_stage_that_reads_them, 2):
        assert kept_first and kept_second and emptied
        assert not outstanding, "on CPU the stage ran on the calling thread: nothing to keep"
        assert grads == [[3.5], [3.5]], grads  # (1 + 2 on rank 0, 1 + 3 on rank 1) averaged


@pytest.mark.slow  # among the quick suite's longest (CI runs it on torch 2.13)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is missing")
def test_step_time_device_cuda_fails_clearly_without_cuda():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "step_time.py"
    out = subprocess.run([sys.executable, str(script), "--device", "cuda"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert "--device cuda: CUDA is not available here" in out.stderr, out.stderr
