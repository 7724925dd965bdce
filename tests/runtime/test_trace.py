"""The event trace of a training step, pinned: what FSDP gathers, frees and reduces, in order.

A 3-block Transformer, each block sharded and the root holding the embeddings, norm
and output head, on 2 ranks. Every rank must issue the same collectives in the same
order (otherwise they would deadlock or mix up data), so the ranks' traces must agree;
the trace itself is pinned with expecttest (``EXPECTTEST_ACCEPT=1`` rewrites it after
an intended change).
"""

from __future__ import annotations

import expecttest
import torch
import torch.distributed as dist

import fsdp2
from tests._dist import run_on_ranks
from tests._models import Transformer, lm_loss, make_batch


def _traced_steps(block_reshard_after_forward: bool | None, steps: int) -> list[list[str]]:
    """Train ``steps`` steps; return each step's forward + backward events on this rank."""
    model = Transformer()
    for block in model.layers:
        fsdp2.fully_shard(block, reshard_after_forward=block_reshard_after_forward)
    fsdp2.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    traces = []
    for step in range(steps):
        inputs, targets = make_batch(dist.get_rank(), step)
        with fsdp2.record_schedule() as events:
            lm_loss(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad()
        traces.append(list(events))
    return traces


def _run(block_reshard_after_forward: bool | None, steps: int) -> list[list[str]]:
    per_rank = run_on_ranks(_traced_steps, 2, block_reshard_after_forward, steps)
    assert all(traces == per_rank[0] for traces in per_rank), per_rank
    return per_rank[0]


def _counts(events: list[str]) -> str:
    return (f"all_gather={sum(e.startswith('unshard ') for e in events)} "
            f"reduce_scatter={sum(e.startswith('reduce_scatter ') for e in events)}")


class TestTrace(expecttest.TestCase):
    def test_default_trace(self):
        # The steady state (second step). Forward: the root gathers once and keeps its
        # parameters to the end of backward (it is needed again first in backward, and user
        # code may read them meanwhile, as with torch); each group issues the next group's
        # all-gather (in the previous step's order) before it computes, so at most two groups
        # are unsharded at once. Backward runs in reverse: gathering a block also prefetches
        # the one before it, each block reduce-scatters and frees once its gradients are done;
        # the root reduces and frees last, at the end of backward.
        _first, events = _run(None, 2)
        self.assertExpectedInline("\n".join(events), """\
unshard root
unshard layers.0
unshard layers.1
reshard layers.0
unshard layers.2
reshard layers.1
reshard layers.2
unshard layers.2
unshard layers.1
reshard layers.2
reduce_scatter layers.2
unshard layers.0
reshard layers.1
reduce_scatter layers.1
reshard layers.0
reduce_scatter layers.0
reshard root
reduce_scatter root""")

    def test_blocks_keep_params_after_forward_trace(self):
        # reshard_after_forward=False: no all-gathers in backward at all.
        (events,) = _run(False, 1)
        self.assertExpectedInline("\n".join(events), """\
unshard root
unshard layers.0
unshard layers.1
unshard layers.2
reshard layers.2
reduce_scatter layers.2
reshard layers.1
reduce_scatter layers.1
reshard layers.0
reduce_scatter layers.0
reshard root
reduce_scatter root""")

    def test_collective_counts_per_step(self):
        lines = []
        for name, policy in (("default", None), ("keep", False)):
            first, second, third = _run(policy, 3)
            self.assertEqual(third, second)  # steady state from the second step on
            self.assertEqual(_counts(first), _counts(second))  # only the order differs at first
            lines.append(f"{name}: {_counts(first)}")
        self.assertExpectedInline("\n".join(lines), """\
default: all_gather=7 reduce_scatter=4
keep: all_gather=4 reduce_scatter=4""")

    def test_at_most_two_blocks_unsharded_at_once(self):
        # The prefetch schedule's memory bound: besides the root (which keeps its parameters
        # from forward to backward by default), never more than two groups are gathered.
        for events in _run(None, 3):
            live: set[str] = set()
            peak = 0
            for event in events:
                kind, label = event.split(" ", 1)
                if kind == "unshard":
                    live.add(label)
                elif kind == "reshard":
                    live.discard(label)
                peak = max(peak, len(live - {"root"}))
            self.assertLessEqual(peak, 2, events)
            self.assertEqual(peak, 2, events)  # and prefetching really overlaps two groups



def _forward_with_instrumented_compute() -> list[str]:
    """Steady-state forward events, with each block's compute and the all-gathers in flight during it."""
    from fsdp2._common import ShardState

    model = Transformer()
    for block in model.layers:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    blocks = list(model.layers)
    log: list[str] = []  # the list record_schedule is filling: compute events go in between

    def in_flight() -> str:
        gathering = [f"layers.{i}" for i, b in enumerate(blocks)
                     if b._fsdp_state().group.state is ShardState.GATHERING]
        return ", ".join(gathering) or "nothing"

    for i, block in enumerate(blocks):
        # Registered after fully_shard: the pre-hook runs once the block's own parameters are
        # gathered, the (prepended) post-hook before the block reshards.
        block.register_forward_pre_hook(lambda *_, i=i: log.append(
            f"compute layers.{i} begins; all-gathers in flight: {in_flight()}"))
        block.register_forward_hook(lambda *_, i=i: log.append(f"compute layers.{i} ends"), prepend=True)
    for step in range(2):  # the second forward prefetches in the first one's order
        inputs, targets = make_batch(dist.get_rank(), step)
        with fsdp2.record_schedule() as events:
            log = events
            loss = lm_loss(model(inputs), targets)
        loss.backward()
    return list(log)


class TestOverlap(expecttest.TestCase):
    def test_next_all_gather_is_in_flight_while_a_block_computes(self):
        per_rank = run_on_ranks(_forward_with_instrumented_compute, 2)
        assert per_rank[0] == per_rank[1], per_rank
        # Each block computes while the next block's all-gather is issued and not yet waited
        # for; the last block overlaps nothing (the root's rest is already gathered).
        self.assertExpectedInline("\n".join(per_rank[0]), """\
unshard root
unshard layers.0
unshard layers.1
compute layers.0 begins; all-gathers in flight: layers.1
compute layers.0 ends
reshard layers.0
unshard layers.2
compute layers.1 begins; all-gathers in flight: layers.2
compute layers.1 ends
reshard layers.1
compute layers.2 begins; all-gathers in flight: nothing
compute layers.2 ends
reshard layers.2""")


def _profiled_step() -> list[str]:
    """fsdp2's profiler ranges in a step under torch.profiler (they are skipped when it is off)."""
    model = Transformer()
    for block in model.layers:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    inputs, targets = make_batch(dist.get_rank(), 0)
    lm_loss(model(inputs), targets).backward()  # lazy init outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        lm_loss(model(inputs), targets).backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("fsdp2::")})


def test_collectives_are_named_in_the_profile():
    seen = run_on_ranks(_profiled_step, 2)[0]
    assert "fsdp2::all_gather layers.0" in seen and "fsdp2::all_gather_wait layers.0" in seen
    assert "fsdp2::reduce_scatter layers.0" in seen, seen
