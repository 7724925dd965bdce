"""The memory planner on the recipe's mixture of experts (expert parallelism, experts in their own groups).

The planner's prediction (``estimate_memory``, run here on the meta device, routing assumed
balanced) against a ``MemoryTracker`` measuring the recipe's model on 4 gloo ranks, sharded
by the recipe's own ``parallelize`` (the second step, rank 0): the same targets as the dense
model's (tests/tools/test_memory.py): peak within 10%, each category within 15%.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp2 import MemoryTracker
from fsdp2.plan import Layout, ModelBuilder, estimate_memory
from fsdp2.models.llama import ModelArgs, Transformer
from fsdp2.plan import main as plan_main
from tests._dist import run_on_ranks

ARGS = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1024, max_seq_len=64, moe_experts=8,
            moe_top_k=2, moe_hidden=128, moe_shared_experts=1)
BATCH, SEQ = 2, 64


def _recipe_argv(ep: int, replicate: int) -> list[str]:
    model = [f"--model.{k}={v}" for k, v in ARGS.items()]
    return [*model, f"--training.seq_len={SEQ}", f"--training.batch_size={BATCH}", "--ep", str(ep),
            "--dp-replicate", str(replicate)]


def _track(ep: int, replicate: int):
    from recipes.config import parse_args
    from recipes.llama.parallelize import ParallelDims, check_layout
    from recipes.build import build_model

    config = parse_args(_recipe_argv(ep, replicate))
    p = config.parallelism
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, dist.get_world_size(), ep=p.ep)
    check_layout(dims, config)
    dims.build_mesh("cpu")
    model = build_model(config, dims, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(dist.get_rank())

    def step() -> None:
        tokens = torch.randint(0, ARGS["vocab_size"], (BATCH, SEQ + 1), generator=gen)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with MemoryTracker(model, opt) as tracker:
        step()
    return tracker.report


def _inputs(batch: int, seq: int) -> torch.Tensor:
    return torch.zeros(batch, seq + 1, dtype=torch.long)[:, :-1]  # as the step above slices them


@pytest.mark.slow
@pytest.mark.parametrize("ep, replicate", [(2, 1), (2, 2)])
def test_planner_matches_tracker_on_moe_with_expert_parallelism(ep, replicate):
    from benchmarks.memory import compare

    measured = run_on_ranks(_track, 4, ep, replicate, timeout=300.0)[0]
    layout = Layout(world=4, dp_replicate=replicate, ep=ep, batch=BATCH, seq=SEQ, param_dtype=torch.float32,
                    reduce_dtype=torch.float32, backend="gloo")
    margs = ModelArgs(**ARGS)
    est = estimate_memory(layout, ModelBuilder(build=lambda: Transformer(margs), make_inputs=_inputs))
    rows = compare(measured, est)
    assert all(row["ok"] for row in rows.values()), (str(measured), str(est), rows)


def test_plan_cli_moe_flags_and_errors(capsys):
    plan_main(["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--vocab-size", "256", "--seq", "32",
               "--moe-experts", "4", "--moe-top-k", "2", "--world", "4", "--ep", "2", "--backend", "gloo"])
    out = capsys.readouterr().out
    assert "dp_shard 4 (efsdp 2 x ep 2)" in out and "total" in out
    with pytest.raises(SystemExit):
        plan_main(["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--vocab-size", "256", "--moe-experts", "4",
                   "--world", "4", "--ep", "3"])
    assert "ep (3) must divide the shard axis" in capsys.readouterr().err


def test_experts_sharded_over_fewer_ranks_cost_more_memory():
    # The experts' shards: over efsdp = 4 / ep ranks; the rest of the model over all 4.
    margs = ModelArgs(**ARGS)
    per_ep = {ep: estimate_memory(Layout(world=4, ep=ep, batch=BATCH, seq=SEQ, backend="gloo"),
                                  ModelBuilder.llama(margs)) for ep in (1, 4)}
    # The same number of parameter elements per rank either way (each rank: 1/4 of the experts).
    assert abs(per_ep[1].peak_by_category["sharded_params"] - per_ep[4].peak_by_category["sharded_params"]) < 1024
    # ep 4 gathers no expert (efsdp is 1 rank): less unsharded memory at the peak.
    assert per_ep[4].peak_by_category["unsharded_params"] < per_ep[1].peak_by_category["unsharded_params"]


def test_pipelined_expert_parallel_layout_is_refused():
    from fsdp2.plan import Layout

    with pytest.raises(ValueError, match=r"pp \(2\) with ep \(2\) is not planned yet"):
        Layout(world=8, batch=1, seq=16, pp=2, ep=2)
