"""Resharding per node (an int ``reshard_after_forward``) through the recipe and the planner's command line.

- The recipe: ``parallelism.reshard_after_forward`` takes an int N (TOML or command line) that
  must divide dp_shard; the blocks reshard to N ranks, the root as "default". On 4 gloo ranks
  (dp_shard 4) the recipe trains with N=2 exactly as with "default" (the same parameters are
  gathered again, from fewer ranks): the same losses and gradient norms, step for step.
- The planner: ``--reshard-after-forward N``, a recipe TOML's int, the pre-flight check's flags
  (``plan_argv``) and their way back to the recipe's (``recipe_flags``).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist

from fsdp2 import plan
from fsdp2.plan import _cli
from fsdp2.runtime._state import get_state
from recipes import preflight
from recipes.config import ConfigError, parse_args
from recipes.llama.parallelize import ParallelDims, check_layout, fsdp_kwargs
from recipes.build import build_model
from recipes.train import train
from tests._dist import run_on_ranks

SMALL_MODEL = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
               "--model.max_seq_len=32", "--training.seq_len=32"]
RUN = [*SMALL_MODEL, "--training.batch_size=2", "--training.steps=3", "--training.warmup_steps=1",
       "--training.lr=1e-2", "--metrics.log_every=1", "--dp-shard", "4"]


# ---- the recipe's config and layout ----------------------------------------------------------
def test_recipe_takes_an_int_and_refuses_what_cannot_run(tmp_path):
    assert parse_args(["--parallelism.reshard_after_forward=2"]).parallelism.reshard_after_forward == 2
    toml = tmp_path / "per_node.toml"
    toml.write_text("[parallelism]\nreshard_after_forward = 8\n")
    assert parse_args(["--config", str(toml)]).parallelism.reshard_after_forward == 8
    with pytest.raises(ConfigError, match=r"reshard_after_forward=0: an int is the ranks .* must be > 0"):
        parse_args(["--parallelism.reshard_after_forward=0"])
    with pytest.raises(ConfigError, match=r"must be one of 'default', 'always', 'never' or an int, got 'node'"):
        parse_args(["--parallelism.reshard_after_forward=node"])

    def layout(flags: list[str], dims: ParallelDims) -> None:
        check_layout(dims, parse_args([*SMALL_MODEL, *flags]))

    with pytest.raises(ValueError, match=r"reshard_after_forward=3 must divide dp_shard \(8\).*one of \[1, 2, 4, 8\]"):
        layout(["--parallelism.reshard_after_forward=3"], ParallelDims(1, 8, 1, 8))
    with pytest.raises(ValueError, match=r"reshard_after_forward=2 \(an int\) does not run with tp > 1 yet"):
        layout(["--parallelism.reshard_after_forward=2"], ParallelDims(1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"does not run with quantize_weights yet"):
        layout(["--parallelism.reshard_after_forward=2", "--parallelism.quantize_weights=int8"],
               ParallelDims(1, 4, 1, 4))
    layout(["--parallelism.reshard_after_forward=4", "--parallelism.quantize_weights=int8"],  # 4 = dp_shard: True
           ParallelDims(1, 4, 1, 4))
    layout(["--parallelism.reshard_after_forward=2"], ParallelDims(2, 4, 1, 8))  # HSDP: groups within a replica
    config = parse_args([*SMALL_MODEL, "--parallelism.reshard_after_forward=2"])
    assert fsdp_kwargs(config)["reshard_after_forward"] == 2
    assert fsdp_kwargs(config, root=True)["reshard_after_forward"] is None  # the root as "default"
    assert fsdp_kwargs(config, pipelined=True, root=True)["reshard_after_forward"] is False


# ---- training with it: the same run as "default" -------------------------------------------------
def _train_with(argv: list[str], per_node: bool) -> None:
    config = parse_args(argv)
    p = config.parallelism
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, dist.get_world_size())
    check_layout(dims, config)
    if per_node:  # what the recipe hands fully_shard: the blocks reshard to 2 ranks, the root keeps its own
        dims.build_mesh("cpu")
        model = build_model(config, dims, torch.device("cpu"))
        block, root = get_state(model.layers[0]).group, get_state(model).group
        assert block.policy.reshard_after_forward == 2 and block.subgroup.size == 2
        assert root.subgroup is None and root.policy.reshard_after_forward is None  # (None: kept, at lazy init)
        del model
    train(config, dims, torch.device("cpu"))


@pytest.mark.slow
def test_recipe_trains_resharding_to_two_ranks_as_default(tmp_path):
    records = {}
    for name, flags in (("default", []), ("per_node", ["--parallelism.reshard_after_forward=2"])):
        metrics = tmp_path / f"{name}.jsonl"
        run_on_ranks(_train_with, 4, [*RUN, *flags, "--metrics-file", str(metrics)], name == "per_node",
                     timeout=240.0)
        records[name] = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records["per_node"]] == [1, 2, 3]
    for ours, default in zip(records["per_node"], records["default"]):
        for key in ("loss", "grad_norm", "lr"):
            assert ours[key] == default[key], (ours["step"], key, ours[key], default[key])
    assert records["per_node"][-1]["loss"] < records["per_node"][0]["loss"]


# ---- the planner ------------------------------------------------------------------------------
def test_planner_command_line_takes_an_int(tmp_path, capsys):
    base = ["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--vocab-size", "256", "--seq", "32",
            "--world", "8", "--backend", "gloo", "--gpu-memory", "1GiB"]
    fit = plan.check_fit([*base, "--reshard-after-forward", "4"])
    assert "reshard_after_forward=4" in fit.estimate.layout
    full = plan.check_fit([*base, "--reshard-after-forward", "true"])
    assert fit.estimate.peak_bytes >= full.estimate.peak_bytes  # the kept quarter of each block on top
    assert fit.estimate.comm_bytes_per_step < full.estimate.comm_bytes_per_step  # backward gathers over 4, not 8
    for bad, match in (("1", r"'1' is ambiguous: write true or false"), ("3", r"must divide dp_shard \(8\)"),
                       ("x", r"expected true, false or an int N >= 2")):
        with pytest.raises(SystemExit):
            plan.main([*base, "--reshard-after-forward", bad])
        assert re.search(match, capsys.readouterr().err), bad
    # A recipe TOML's int: the blocks reshard to that many ranks, the root is kept.
    toml = tmp_path / "per_node.toml"
    toml.write_text("[parallelism]\nreshard_after_forward = 2\n[model]\ndim = 64\nn_layers = 2\nn_heads = 4\n"
                    "vocab_size = 256\n[training]\nseq_len = 32\nbatch_size = 1\n")
    args = _cli._parse(_cli._parser(), ["--config", str(toml), "--world", "8"])
    assert (args.reshard_after_forward, args.root_reshard_after_forward) == (2, False)


def test_preflight_passes_the_int_to_the_planner_and_back():
    def flags(value: str, dims: ParallelDims) -> str:
        config = parse_args([*SMALL_MODEL, f"--parallelism.reshard_after_forward={value}"])
        argv = preflight.plan_argv(config, dims, "cpu", 2**30)
        return dict(zip(argv[::2], argv[1::2]))["--reshard-after-forward"]

    assert flags("8", ParallelDims(1, 16, 1, 16)) == "8"
    assert flags("16", ParallelDims(1, 16, 1, 16)) == "true"  # the whole shard axis
    assert flags("1", ParallelDims(1, 16, 1, 16)) == "false"  # one rank: kept
    assert flags("default", ParallelDims(1, 16, 1, 16)) == "true"
    assert preflight.recipe_flags("--reshard-after-forward 8") == "--parallelism.reshard_after_forward=8"
    assert preflight.recipe_flags("--reshard-after-forward true") == "--parallelism.reshard_after_forward=default"
    # under a pipeline the recipe's "default" keeps the blocks' parameters: resharding is "always" there
    assert preflight.recipe_flags("--reshard-after-forward true", pipelined=True) == \
        "--parallelism.reshard_after_forward=always"
    assert preflight.recipe_flags("--reshard-after-forward 8", pipelined=True) == \
        "--parallelism.reshard_after_forward=8"

