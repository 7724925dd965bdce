"""A process that plans (``fsdp2.plan.check_fit``, the recipe's pre-flight) and then trains.

The planner runs fsdp2 over a fake process group; DTensor's sharding-propagation caches compare
meshes by value, so a simulated mesh left there was handed to the real run's mesh of the same
shape, and DTensor's random initialisation then took rank 0's coordinates on every rank: every
rank of a model built on meta and initialised after sharding got rank 0's initial weights.

Each rank here is a fresh process (the test pool's ranks already have a process group, and
the planner needs a process without one): it builds the recipe's model as ``train.py`` does,
with and without planning first, and the shards must be byte for byte the same. The ranks are
forked from the test pool's forkserver (tests/_dist.py), which imported torch and nothing more:
no process group, no planner run, without each rank importing torch again. The same holds
where numpy cannot be imported (torch does not need it; the Quickstart's fresh virtualenv lacks
it): the caches are emptied without torch's debug package, which imports numpy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recipes.preflight import check_memory
from recipes.build import build_model
from recipes.checks import check_command
from tests._dist import _context

ARGV = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.max_seq_len=32", "--training.seq_len=32", "--training.batch_size=2"]


def _rank(rank: int, world: int, argv: list[str], plan: bool, out: str, env: dict[str, str], numpy: bool) -> None:
    os.environ.clear()  # the test's environment, as a spawned rank's (not the forkserver's)
    os.environ.update(env)
    torch.set_num_threads(1)
    if not numpy:  # from here on `import numpy` raises ImportError, as on a machine without it
        assert not any(name.startswith("torch.distributed.tensor.debug") for name in sys.modules)
        sys.modules["numpy"] = None  # type: ignore[assignment]
    config, dims = check_command(argv, world)
    if plan:
        assert check_memory(config, dims, "cpu") is not None  # the planner ran in this process
    # a file store: a random TCP port can be taken by a test running beside this one
    store = Path(out) / f"store-plan{int(plan)}"
    dist.init_process_group("gloo", init_method=store.as_uri(), rank=rank, world_size=world)
    try:
        dims.build_mesh("cpu")
        model = build_model(config, dims, torch.device("cpu"))
        shards = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
        torch.save(shards, Path(out) / f"plan{int(plan)}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout, numpy", [(["--dp-shard", "2"], True), (["--dp-shard", "2"], False),
                                           pytest.param(["--parallelism.tp=2", "--dp-shard", "1"], True,
                                                        marks=pytest.mark.slow)],
                         ids=["fsdp", "fsdp-without-numpy", "tp"])
def test_planning_first_leaves_each_ranks_initial_weights_as_they_were(tmp_path, layout, numpy):
    argv = [*ARGV, *layout]
    for plan in (False, True):
        mp.start_processes(_rank, args=(2, argv, plan, str(tmp_path), dict(os.environ), numpy), nprocs=2,
                           start_method=_context().get_start_method())
    for rank in range(2):
        alone = torch.load(tmp_path / f"plan0-rank{rank}.pt")
        planned = torch.load(tmp_path / f"plan1-rank{rank}.pt")
        assert alone.keys() == planned.keys()
        for name in alone:
            assert torch.equal(alone[name], planned[name]), f"rank {rank}'s {name} changed by planning first"
    # the ranks hold different values (each its own shard, or its own init of a sharded weight)
    ranks = [torch.load(tmp_path / f"plan1-rank{r}.pt") for r in range(2)]
    assert not torch.equal(ranks[0]["layers.0.attention.wq.weight"], ranks[1]["layers.0.attention.wq.weight"])
