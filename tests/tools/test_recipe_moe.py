"""The recipe's mixture of experts with expert parallelism (recipes/llama/moe.py, fsdp2/models/moe.py).

- Config errors, in-process: each names the key and the fix, before any process group.
- On 4 gloo ranks, the same small MoE model, seed and global batch trained by ``train()`` for a
  few steps at ep 1, 2 and 4 (dp_shard 4) and with HSDP (dp_replicate 2 x dp_shard 2, ep 2):
  the losses and gradient norms agree to float tolerance (routing does not depend on ep), the
  experts live on the (dp_replicate,) efsdp x ep mesh, and the loss falls.
- The ep 2 run resumed from its step-2 checkpoint repeats the uninterrupted run's losses exactly.
- The recipe's sharding with torch's ``fully_shard`` in place of fsdp2's gives bit-identical
  losses and gradients (ep 2).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from recipes.config import ConfigError, parse_args
from recipes.llama.parallelize import ParallelDims, check_layout
from recipes.checks import check_command
from recipes.train import train
from tests._dist import run_on_ranks

MOE_MODEL = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
             "--model.max_seq_len=32", "--model.moe_experts=4", "--model.moe_top_k=2", "--model.moe_hidden=32",
             "--model.moe_shared_experts=1", "--training.seq_len=32", "--training.batch_size=2",
             "--training.warmup_steps=1", "--training.lr=1e-2", "--metrics.log_every=1", "--metrics.plot=false",
             "--metrics.sample_tokens=0"]
STEPS = 4


# ---- configuration (in-process) -----------------------------------------------------------
@pytest.mark.parametrize("args, world, match", [
    (["--ep", "2"], 4, r"parallelism.ep=2 shards experts, and this model has none \(model.moe_experts=0\)"),
    ([*MOE_MODEL, "--model.moe_experts=6", "--ep", "4"], 4,
     r"model.moe_experts \(6\) must be divisible by parallelism.ep \(4\)"),
    ([*MOE_MODEL, "--ep", "4", "--dp-shard", "2", "--dp-replicate", "2"], 4,
     r"parallelism.ep \(4\) must divide parallelism.dp_shard \(2\)"),
    ([*MOE_MODEL, "--model.moe_top_k=5"], 4, r"model.moe_top_k \(5\) must be between 1 and model.moe_experts \(4\)"),
    ([*MOE_MODEL, "--ep", "0"], 4, r"parallelism.ep must be > 0, got 0"),
    ([*MOE_MODEL, "--training.compile"], 2, r"training.compile is not supported with model.moe_experts > 0"),
    ([*MOE_MODEL, "--tp", "2"], 4, r"tensor parallelism is not supported with model.moe_experts > 0"),
    ([*MOE_MODEL, "--pp", "2", "--dp-shard", "2"], 4, r"parallelism.pp=2 with model.moe_experts > 0 is not supported"),
    ([*MOE_MODEL, "--model.moe_load_balance_coeff=-1"], 2, r"model.moe_load_balance_coeff must be >= 0"),
])
def test_moe_config_errors_name_the_key_and_fix(args, world, match):
    with pytest.raises(ValueError, match=match) as caught:
        check_command(args, world)
    assert isinstance(caught.value, ConfigError) or "tensor parallelism" in match


def test_tiny_moe_config_checks_on_4_ranks():
    config, dims = check_command(["--config", "recipes/configs/tiny_moe.toml"], 4)
    assert (dims.dp_shard, dims.ep, config.model.moe_experts) == (4, 2, 8)


# ---- training on 4 ranks --------------------------------------------------------------------
def _train(argv: list[str]) -> int:
    config = parse_args(argv)
    p = config.parallelism
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, dist.get_world_size(), ep=p.ep)
    check_layout(dims, config)
    return train(config, dims, torch.device("cpu"))


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


LAYOUTS = {"ep1": ["--ep", "1"], "ep2": ["--ep", "2"], "ep4": ["--ep", "4"],
           "hsdp_ep2": ["--dp-replicate", "2", "--dp-shard", "2", "--ep", "2"]}


def _runs(root: str) -> dict:
    """Every layout's run (ep 2 with checkpoints), then ep 2 resumed from step 2; the experts' meshes."""
    out = {}
    for name, flags in LAYOUTS.items():
        ckpt = ["--checkpoint-dir", f"{root}/{name}/ckpt", "--checkpoint-every", "2"] if name == "ep2" else []
        _train([*MOE_MODEL, f"--training.steps={STEPS}", *flags, *ckpt, "--metrics-file", f"{root}/{name}.jsonl"])
    if dist.get_rank() == 0:
        resumed = Path(root) / "resumed"
        resumed.mkdir()
        shutil.copytree(Path(root) / "ep2" / "ckpt" / "step-00000002", resumed / "step-00000002")
    dist.barrier()
    out["resumed_from"] = _train([*MOE_MODEL, f"--training.steps={STEPS}", "--ep", "2", "--checkpoint-dir",
                                  f"{root}/resumed", "--metrics-file", f"{root}/resumed.jsonl"])
    return out


def _mesh_of_experts(flags: list[str]) -> tuple:
    from recipes.build import build_model
    config = parse_args([*MOE_MODEL, *flags])
    p = config.parallelism
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, dist.get_world_size(), ep=p.ep)
    dims.build_mesh("cpu")
    model = build_model(config, dims, torch.device("cpu"))
    w1, wq = model.layers[0].feed_forward.experts.w1, model.layers[0].attention.wq.weight
    assert isinstance(w1, DTensor)
    return w1.device_mesh.mesh_dim_names, tuple(w1.to_local().shape), wq.device_mesh.mesh_dim_names


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    result = run_on_ranks(_runs, 4, str(root), timeout=600.0)[0]
    return root, result


@pytest.mark.slow  # five short trainings on 4 ranks
def test_losses_do_not_depend_on_ep_and_fall(moe_runs):
    root, _ = moe_runs
    runs = {name: _records(root / f"{name}.jsonl") for name in LAYOUTS}
    reference = runs["ep1"]
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))
    assert reference[0]["loss"] == pytest.approx(math.log(256), abs=0.05)
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.3, [r["loss"] for r in reference]
    for name, records in runs.items():
        for r, ref in zip(records, reference, strict=True):
            assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-5), (name, r["step"])
            assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4, abs=1e-5), (name, r["step"])


@pytest.mark.slow  # moe_runs
def test_ep_run_resumes_exactly(moe_runs):
    root, result = moe_runs
    assert result["resumed_from"] == 2
    full, resumed = _records(root / "ep2.jsonl"), _records(root / "resumed.jsonl")
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        ref = full[r["step"] - 1]
        assert (r["loss"], r["grad_norm"], r["lr"]) == (ref["loss"], ref["grad_norm"], ref["lr"]), r["step"]


def test_experts_live_on_efsdp_x_ep():
    # 4 experts of (32 x 32); ep 2 keeps 2 per ep rank, sharded over efsdp 2 along experts (dim 0).
    results = run_on_ranks(_mesh_of_experts, 4, ["--ep", "2"])
    assert results[0] == (("efsdp", "ep"), (1, 32, 32), ("dp_shard",))


@pytest.mark.slow
def test_hsdp_experts_live_on_dp_replicate_x_efsdp_x_ep():
    # efsdp 1: each ep rank keeps its 2 experts whole, replicated over dp_replicate.
    results = run_on_ranks(_mesh_of_experts, 4, ["--dp-replicate", "2", "--dp-shard", "2", "--ep", "2"])
    assert results[0] == (("dp_replicate", "efsdp", "ep"), (2, 32, 32), ("dp_replicate", "dp_shard"))


# ---- against torch's fully_shard ------------------------------------------------------------
def _recipe_vs_torch(flags: list[str], steps: int = 2) -> dict:
    """The recipe's sharding (ep, experts on efsdp) with fsdp2's and with torch's fully_shard; the experts
    reduce by sum, then divide (torch's other way, PREMUL_SUM, does not exist on gloo)."""
    import importlib

    import fsdp2
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from recipes.data import get_batch, load_corpus
    from fsdp2.models.moe import moe_layers
    from recipes.build import build_model

    parallelize = importlib.import_module("recipes.llama.parallelize")  # (the package exports a function so named)
    config = parse_args([*MOE_MODEL, *flags])
    p = config.parallelism
    models = []
    def torch_impl(module, *, comm_policy=None, **kwargs):  # torch's has no comm_policy (the recipe's is all off)
        return torch_fully_shard(module, **kwargs)

    for impl in (fsdp2.fully_shard, torch_impl):
        dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, dist.get_world_size(), ep=p.ep)
        dims.build_mesh("cpu")
        saved = fsdp2.fully_shard, parallelize.fully_shard
        fsdp2.fully_shard = parallelize.fully_shard = impl  # (fsdp2.models.moe reads fsdp2.fully_shard)
        try:
            models.append(build_model(config, dims, torch.device("cpu")))
        finally:
            fsdp2.fully_shard, parallelize.fully_shard = saved
    for model in models:  # torch's divide by another factor than the group's is a PREMUL_SUM, which gloo lacks
        for moe in moe_layers(model):
            moe.experts.set_force_sum_reduction_for_comms(True)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    corpus = load_corpus(None)
    losses, grads_equal = [], True
    for step in range(steps):
        inputs, targets = get_batch(corpus, seed=0, step=step, rank=dist.get_rank(), micro=0, batch_size=2, seq_len=32)
        step_losses = []
        for model in models:
            loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            loss.backward()
            step_losses.append(loss.item())
        grads = [[q.grad.full_tensor() for q in m.parameters()] for m in models]
        grads_equal &= all(torch.equal(a, b) for a, b in zip(*grads))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(step_losses)
    w1 = [m.layers[0].feed_forward.experts.w1 for m in models]
    return {"losses_equal": all(a == b for a, b in losses), "grads_equal": grads_equal,
            "experts_equal": torch.equal(w1[0].full_tensor(), w1[1].full_tensor()),
            "layouts": [(w.device_mesh.mesh_dim_names, tuple(w.placements)) for w in w1]}


@pytest.mark.slow
def test_recipe_ep_matches_torch_fully_shard_bit_for_bit():
    for r in run_on_ranks(_recipe_vs_torch, 4, ["--ep", "2"], timeout=300.0):
        assert r["losses_equal"] and r["grads_equal"] and r["experts_equal"], r
        assert r["layouts"][0] == r["layouts"][1], r
