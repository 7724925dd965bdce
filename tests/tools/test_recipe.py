"""The Llama recipe: config parsing, parallel layout, the model under FSDP/TP, and train.py end to end.

- Config and ParallelDims errors are checked in-process (no ranks needed).
- On a 2-rank gloo world: the meta-built, FSDP-sharded (activation-checkpointed) model starts
  from exactly the unsharded model's weights and trains like it for two steps of the recipe's
  optimizer, schedule and gradient clipping; the tensor-parallel plan matches the unsharded
  model's loss and gradients.
- On a 4-rank world, for HSDP (dp_replicate 2 x dp_shard 2) and FSDP x TP (dp_shard 2 x tp 2):
  the meta-built model starts from the unsharded weights and its first loss and clipped
  gradient norm match the unsharded model's.
- ``torchrun recipes/train.py`` runs once as a subprocess on 2 ranks (8 steps, checkpoints at
  4 and 8, safetensors export); ``train()`` runs in the 2-rank world resumed from its step-4
  checkpoint, and in the 4-rank world for each 2-D layout (6 steps, checkpoint at 3), then
  resumed from step 3. Losses are finite and fall; a resumed run's losses, learning rates
  and gradient norms equal the uninterrupted run's, step for step.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import fsdp2
from recipes.config import ConfigError, load_config, parse_args
from recipes.data import ByteTokenizer, get_batch, load_corpus
from recipes.llama.model import ModelArgs, Transformer
from recipes.llama.parallelize import ParallelDims, check_layout, tp_plan
from recipes.build import build_model, build_optimizer, lr_schedule
from recipes.progress import model_flops_per_token
from recipes.train import train
from recipes.train import main as train_main
from tests._dist import run_on_ranks
from tests._models import lm_loss, make_batch
from tests._parity import average_grads, full
from tests._together import run_together

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes" / "train.py"

SMALL_MODEL = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
               "--model.max_seq_len=32", "--training.seq_len=32"]


# ---- config parsing (in-process) ----------------------------------------------------------
def test_default_config_and_overrides():
    default = parse_args([])
    assert default.training.steps == 300 and default.model.dim == 128  # the checked-in tiny.toml
    cfg = parse_args(["--training.lr=0.01", "--training.steps", "7", "--training.activation_checkpoint",
                      "--training.mixed_precision=bf16", "--dp-shard", "2", "--checkpoint-dir=/tmp/x",
                      "--model.n_kv_heads=none", "--data", "corpus.txt"])
    assert cfg.training.lr == 0.01 and cfg.training.steps == 7
    assert cfg.training.activation_checkpoint is True and cfg.training.mixed_precision == "bf16"
    assert cfg.parallelism.dp_shard == 2 and cfg.checkpoint.dir == "/tmp/x" and cfg.data.path == "corpus.txt"
    assert cfg.model.n_kv_heads is None and cfg.model.kv_heads == cfg.model.n_heads
    assert parse_args(["--training.steps=1", "--training.steps=2"]).training.steps == 2  # last one wins


@pytest.mark.parametrize("args, match", [
    (["--training.lrr=1e-3"], r"unknown key 'training.lrr' \(from --training.lrr=1e-3\); did you mean 'training.lr'\?"),
    (["--trainng.lr=1e-3"], r"unknown config section 'trainng'.*did you mean 'training.lr'\?"),
    (["--training.steps=ten"], r"training.steps must be an int, got 'ten' \(from --training.steps=ten\)"),
    (["--training.lr=fast"], r"training.lr must be a float, got 'fast'"),
    (["--training.compile=maybe"], r"training.compile must be a bool \(true/false\), got 'maybe'"),
    (["--training.mixed_precision=fp16"], r"training.mixed_precision must be one of 'fp32', 'bf16', got 'fp16'"),
    (["--training.steps"], r"--training.steps needs a value: training.steps must be an int"),
    (["--lr=3"], r"unknown option '--lr'; overrides are written --section.key=value"),
    (["steps=3"], r"unexpected argument 'steps=3'"),
    (["--training.steps=0"], r"training.steps must be > 0, got 0"),
    (["--training.seq_len=512"], r"training.seq_len \(512\) exceeds model.max_seq_len \(128\)"),
    (["--model.n_kv_heads=3"], r"model.n_kv_heads \(3\) must be a positive divisor of model.n_heads \(4\)"),
    (["--parallelism.quantize_weights=int2"],
     r"parallelism.quantize_weights must be one of '', 'int8', 'int4', got 'int2'"),
    (["--parallelism.quantize_block_size=0"], r"parallelism.quantize_block_size must be > 0, got 0"),
    (["--parallelism.quantize_error_feedback"],
     r"parallelism.quantize_error_feedback needs parallelism.quantize_gradients=int8"),
    (["--parallelism.quantize_gradient_axes=replicate"],
     r"parallelism.quantize_gradient_axes=replicate needs parallelism.quantize_gradients=int8"),
    (["--parallelism.quantize_gradients=int8", "--parallelism.quantize_gradient_axes=both"],
     r"quantize_gradient_axes=both quantizes the all-reduce across replicas, and dp_replicate=1 has none"),
])
def test_override_errors_are_clear(args, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(args)


def test_config_file_errors_name_the_file(tmp_path):
    bad_key = tmp_path / "bad_key.toml"
    bad_key.write_text("[training]\nstep = 3\n")
    match = rf"unknown key 'training.step' \(from {bad_key}\); did you mean 'training.steps'"
    with pytest.raises(ConfigError, match=match):
        load_config(bad_key)
    bad_type = tmp_path / "bad_type.toml"
    bad_type.write_text('[training]\nsteps = "3"\n')  # TOML keeps types: a string is not an int
    with pytest.raises(ConfigError, match=rf"training.steps must be an int, got '3' \(from {bad_type}\)"):
        load_config(bad_type)
    with pytest.raises(ConfigError, match="does not exist"):
        parse_args(["--config", str(tmp_path / "missing.toml")])
    syntax = tmp_path / "syntax.toml"
    syntax.write_text("[training\n")
    with pytest.raises(ConfigError, match=str(syntax)):
        load_config(syntax)


# ---- data (in-process) --------------------------------------------------------------------
def test_batches_depend_only_on_seed_step_rank_and_micro_batch():
    corpus = load_corpus()  # the standard library's sources
    assert corpus.numel() > 1_000_000 and torch.equal(corpus, load_corpus())

    def batch(**kw):
        args = {"seed": 0, "step": 5, "rank": 1, "micro": 0, "batch_size": 3, "seq_len": 16} | kw
        return get_batch(corpus, **args)

    inputs, targets = batch()
    assert inputs.shape == targets.shape == (3, 16) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next bytes
    assert torch.equal(batch()[0], inputs)
    for change in ({"seed": 1}, {"step": 6}, {"rank": 0}, {"micro": 1}):
        assert not torch.equal(batch(**change)[0], inputs), change
    tokenizer = ByteTokenizer()
    assert tokenizer.encode("é = 1") == [0xC3, 0xA9, 32, 61, 32, 49] and tokenizer.decode([0xC3, 0xA9]) == "é"


# ---- ParallelDims (in-process) ------------------------------------------------------------
def test_parallel_dims_infer_and_validate():
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, tp=1, world_size=4)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp_size) == (1, 4, 1, 4)
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=-1, world_size=8)
    assert dims.tp == 2 and dims.dp_size == 4 and [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="only one of dp_replicate, dp_shard, tp can be -1.*dp_shard and tp"):
        ParallelDims(1, -1, -1, 4)
    with pytest.raises(ValueError, match=r"cannot infer parallelism.dp_shard: the other degrees multiply to 3, "
                                         r"which does not divide the world size 4"):
        ParallelDims(1, -1, 3, 4)
    with pytest.raises(ValueError, match=r"dp_replicate \(1\) \* dp_shard \(2\) \* tp \(2\) = 4, "
                                         r"but the world size is 2"):
        ParallelDims(1, 2, 2, 2)
    with pytest.raises(ValueError, match=r"parallelism.tp must be a positive int or -1 \(infer\), got 0"):
        ParallelDims(1, -1, 0, 2)


def test_check_layout_rejects_what_tp_cannot_split(monkeypatch, capsys):
    config = load_config(None, SMALL_MODEL)  # 4 heads, 2 kv heads, seq 32
    check_layout(ParallelDims(2, 2, 1, 4), config)  # HSDP: anything goes
    check_layout(ParallelDims(1, 2, 2, 4), config)
    with pytest.raises(ValueError, match=r"model.n_heads \(4\) and model.n_kv_heads \(2\) must both be divisible "
                                         r"by tp \(4\)"):
        check_layout(ParallelDims(1, 1, 4, 4), config)
    odd = load_config(None, [*SMALL_MODEL, "--training.seq_len=31"])
    with pytest.raises(ValueError, match=r"training.seq_len \(31\) must be divisible by tp \(2\)"):
        check_layout(ParallelDims(1, 2, 2, 4), odd)
    monkeypatch.setenv("WORLD_SIZE", "4")  # main() checks the layout before any process group starts
    with pytest.raises(SystemExit) as exit_info:
        train_main([*SMALL_MODEL, "--training.seq_len=31", "--tp", "2"])
    assert exit_info.value.code == 2
    assert "training.seq_len (31) must be divisible by tp (2)" in capsys.readouterr().err


# ---- the model under FSDP and TP (2 ranks) -------------------------------------------------
def _fsdp_recipe_matches_unsharded(compile: bool = False) -> list[float]:
    """Meta build + parallelize (with activation checkpointing, and compile if asked) vs the plain
    model, 2 recipe steps."""
    config = load_config(None, [*SMALL_MODEL, "--training.seq_len=16", "--training.activation_checkpoint",
                                "--training.lr=1e-2", "--training.warmup_steps=1", "--training.steps=2",
                                "--training.max_grad_norm=0.5", "--training.seed=3",
                                f"--training.compile={str(compile).lower()}"])
    if compile:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    dims = ParallelDims(1, -1, 1, dist.get_world_size())
    dims.build_mesh("cpu")
    model = build_model(config, dims, torch.device("cpu"))
    ref = Transformer(config.model)
    ref.init_weights(seed=3)
    other = Transformer(config.model)
    other.init_weights(seed=4)
    assert not torch.equal(other.tok_embeddings.weight, ref.tok_embeddings.weight), "the seed must matter"
    # state_dict, not named_parameters: the checkpoint wrapper's hooks hide its name prefix there.
    sharded = model.state_dict()
    assert sharded.keys() == ref.state_dict().keys()
    for name, value in ref.state_dict().items():
        assert torch.equal(full(sharded[name]), value), f"{name}: sharded init differs from unsharded init"
    assert isinstance(sharded["layers.0.attention.wq.weight"], DTensor)

    t = config.training
    opts = [build_optimizer(m, t) for m in (model, ref)]
    scheds = [lr_schedule(o, t) for o in opts]
    losses, norms = [], []
    for step in range(2):
        tokens, targets = make_batch(dist.get_rank(), step, vocab=256)
        step_losses, step_norms = [], []
        for m, opt, sched in zip((model, ref), opts, scheds):
            loss = lm_loss(m(tokens), targets)
            loss.backward()
            if m is ref:
                average_grads(ref)
            step_norms.append(full(torch.nn.utils.clip_grad_norm_(m.parameters(), t.max_grad_norm)).item())
            opt.step()
            sched.step()
            opt.zero_grad()
            step_losses.append(loss.item())
        assert step_norms[0] > t.max_grad_norm, "the test must exercise clipping"
        assert step_norms[0] == pytest.approx(step_norms[1], rel=1e-5), step_norms
        assert step_losses[0] == pytest.approx(step_losses[1], rel=1e-5), step_losses
        losses.append(step_losses[0])
        norms.append(step_norms[0])
    sharded = model.state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(full(sharded[name]), value, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    if compile:  # the blocks did run compiled: one graph for all, no graph break (fullgraph)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
        assert not torch._dynamo.utils.counters["graph_break"]
    return losses


@pytest.mark.slow
def test_fsdp_recipe_matches_unsharded_model():
    losses = run_on_ranks(_fsdp_recipe_matches_unsharded, 2)
    assert all(math.isfinite(x) for rank in losses for x in rank)


@pytest.mark.slow
def test_compiled_fsdp_recipe_matches_unsharded_model():
    """``--training.compile``: each (checkpoint-wrapped) block compiled in place with inductor."""
    losses = run_on_ranks(_fsdp_recipe_matches_unsharded, 2, True, timeout=600)
    assert all(math.isfinite(x) for rank in losses for x in rank)


def _tp_plan_matches_unsharded() -> None:
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
    ref = Transformer(args)
    ref.init_weights(seed=0)
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    tp_plan(model, mesh)
    assert model.layers[0].attention.wq.weight.placements == (Shard(0),)  # column-wise: output features
    assert model.layers[0].attention.wo.weight.placements == (Shard(1),)  # row-wise: input features
    assert model.layers[0].feed_forward.w2.weight.placements == (Shard(1),)
    tokens, targets = make_batch(0, 0, vocab=256)  # TP ranks share their data
    ref_loss = lm_loss(ref(tokens), targets)
    ref_loss.backward()
    loss = lm_loss(model(tokens), targets)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(full(p.grad), ref_params[name].grad, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name}.grad: {m}")
    with pytest.raises(ValueError, match=r"model.n_heads \(4\) and model.n_kv_heads \(1\) must both be divisible"):
        tp_plan(Transformer(ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=1)), mesh)
    with pytest.raises(ValueError, match="tie_embeddings is not supported with tensor parallelism"):
        tp_plan(Transformer(ModelArgs(dim=32, n_layers=1, tie_embeddings=True)), mesh)


def test_tp_plan_matches_unsharded_model():
    run_on_ranks(_tp_plan_matches_unsharded, 2)


# ---- the model under HSDP and FSDP x TP (4 ranks) -------------------------------------------
LAYOUTS = {"hsdp": (2, 2, 1), "fsdp_tp": (1, 2, 2)}  # (dp_replicate, dp_shard, tp)


def _2d_recipe_matches_unsharded(degrees: tuple[int, int, int]) -> tuple[str, ...]:
    """Meta build + parallelize on a 2-D mesh vs the plain model: initial weights, one loss, clipped grads."""
    # vocab 250: the embedding and output rows split unevenly over the ranks (63/62 per TP half).
    config = load_config(None, [*SMALL_MODEL, "--model.vocab_size=250", "--training.seq_len=16",
                                "--training.activation_checkpoint", "--training.seed=3"])
    dims = ParallelDims(*degrees, world_size=dist.get_world_size())
    dims.build_mesh("cpu")
    model = build_model(config, dims, torch.device("cpu"))
    ref = Transformer(config.model)
    ref.init_weights(seed=3)
    sharded = model.state_dict()
    assert sharded.keys() == ref.state_dict().keys()
    for name, value in ref.state_dict().items():
        assert torch.equal(full(sharded[name]), value), f"{name}: sharded init differs from unsharded init"

    tokens, targets = make_batch(dims.dp_rank(dist.get_rank()), 0, vocab=250)  # TP peers share a batch
    loss = lm_loss(model(tokens), targets)
    loss.backward()
    ref_loss = lm_loss(ref(tokens), targets)
    ref_loss.backward()
    average_grads(ref)  # over all ranks: TP peers add identical copies, so this is the dp average
    norm = fsdp2.clip_grad_norm_(model.parameters(), 0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert ref_norm > 0.5, "the test must exercise clipping"
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(norm, ref_norm, atol=1e-5, rtol=1e-4)
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        name = name.replace("._checkpoint_wrapped_module", "")
        torch.testing.assert_close(full(p.grad), ref_grads[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m: f"{name}.grad: {m}")
    return sharded["layers.0.attention.wq.weight"].device_mesh.mesh_dim_names


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_2d_recipe_matches_unsharded_model(layout):
    meshes = run_on_ranks(_2d_recipe_matches_unsharded, 4, LAYOUTS[layout])
    assert meshes[0] == {"hsdp": ("dp_replicate", "dp_shard"), "fsdp_tp": ("dp_shard", "tp")}[layout]


# ---- train.py end to end: torchrun once, then train() in the test worlds --------------------
RUN_ARGS = [*SMALL_MODEL, "--training.batch_size=4", "--training.grad_accum=2",
            "--training.steps=8", "--training.warmup_steps=2", "--training.lr=1e-2",
            "--training.activation_checkpoint", "--training.max_grad_norm=1.0",
            "--metrics.log_every=1", "--checkpoint-every", "4"]
# 4 ranks: fewer steps, and 3 sampled bytes so generation runs on odd lengths under TP.
RUN_ARGS_2D = [*SMALL_MODEL, "--training.batch_size=4", "--training.steps=6", "--training.warmup_steps=1",
               "--training.lr=1e-2", "--metrics.log_every=1", "--checkpoint-every", "3",
               "--metrics.sample_tokens=3"]
LAYOUT_FLAGS = {"hsdp": ["--dp-replicate", "2", "--dp-shard", "2"], "fsdp_tp": ["--dp-shard", "2", "--tp", "2"]}
EXPORTS = {"fsdp": "model.safetensors", "hsdp": "model.pt", "fsdp_tp": "model.safetensors"}


def _torchrun(**launches: list[str]) -> dict[str, subprocess.CompletedProcess]:
    """``torchrun recipes/train.py ARGS`` on 2 ranks for each of ``launches`` (name: ARGS; ARGS
    that start with a ``.py`` file run that script, given train.py and the rest), all started
    together: each keeps one core of two idle while its agent starts and while its ranks wait for
    each other, and side by side one's agent starts while another's ranks work."""
    def command(args: list[str]) -> list[str]:
        script = [args.pop(0)] if args and args[0].endswith(".py") else []
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                *script, str(TRAIN), *args]

    return run_together({name: command(list(args)) for name, args in launches.items()}, timeout=240, cwd=REPO)


def _train_on_ranks(argv: list[str]) -> int:
    """What main() does after init_process_group, in the test's world; returns the resumed step."""
    config = parse_args(argv)
    p = config.parallelism
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, dist.get_world_size())
    check_layout(dims, config)
    return train(config, dims, torch.device("cpu"))


def _records(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def _assert_loss_falls(records: dict[int, dict], steps: int, drop: float) -> None:
    assert sorted(records) == list(range(1, steps + 1))
    losses = [records[s]["loss"] for s in range(1, steps + 1)]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[0] == pytest.approx(math.log(256), abs=0.05), "the initial model predicts bytes uniformly"
    assert max(losses[-2:]) < losses[0] - drop, losses


def _resume(root: Path, world_size: int, args: list[str], step: int, steps: int) -> None:
    """Resume from ``root``'s step-``step`` checkpoint as if killed after it; compare with the full run."""
    resumed = root / "resumed"
    resumed.mkdir()
    name = f"step-{step:08d}"
    shutil.copytree(root / "ckpt" / name, resumed / name)
    # The interrupted run's metrics file: the resumed run drops its steps after ``step`` and appends.
    shutil.copy(root / "a.jsonl", root / "b.jsonl")
    starts = run_on_ranks(_train_on_ranks, world_size,
                          [*args, "--checkpoint-dir", str(resumed), "--metrics-file", str(root / "b.jsonl")])
    assert starts == [step] * world_size, "the run must resume from the checkpoint, not start over"
    assert [json.loads(line)["step"] for line in (root / "b.jsonl").read_text().splitlines()] == \
        list(range(1, steps + 1))
    uninterrupted, after_resume = _records(root / "a.jsonl"), _records(root / "b.jsonl")
    for s in range(step + 1, steps + 1):
        for key in ("loss", "lr", "grad_norm"):
            assert after_resume[s][key] == uninterrupted[s][key], (s, key)


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """This file's torchrun launches, side by side: the full run (2 ranks, 8 steps with checkpoints
    at 4 and 8, an export, and per-step metrics) and one whose command line has a config error,
    its rank 0 starting 4 s after rank 1 (tests/tools/_rank0_late.py)."""
    root = tmp_path_factory.mktemp("fsdp")
    return root, _torchrun(full=[*RUN_ARGS, "--checkpoint-dir", str(root / "ckpt"), "--metrics-file",
                                 str(root / "a.jsonl"), f"--checkpoint.export={root / EXPORTS['fsdp']}"],
                           config_error=[str(Path(__file__).with_name("_rank0_late.py")), "--training.lrr=1"])


@pytest.fixture(scope="module")
def full_run(torchrun_runs):
    root, runs = torchrun_runs
    proc = runs["full"]
    assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return root, proc.stdout


@pytest.fixture(scope="module")
def layout_run(tmp_path_factory):
    """``layout_run(name)``: the 6-step 4-rank run of a 2-D layout (checkpoints at 3 and 6), run once."""
    roots: dict[str, Path] = {}

    def run(layout: str) -> Path:
        if layout not in roots:
            root = tmp_path_factory.mktemp(layout)
            run_on_ranks(_train_on_ranks, 4, [*RUN_ARGS_2D, *LAYOUT_FLAGS[layout], "--checkpoint-dir",
                                              str(root / "ckpt"), "--metrics-file", str(root / "a.jsonl"),
                                              f"--checkpoint.export={root / EXPORTS[layout]}"], timeout=240.0)
            roots[layout] = root
        return roots[layout]

    return run


@pytest.mark.slow  # full_run: train.py under torchrun, end to end
def test_recipe_loss_is_finite_and_falls(full_run):
    root, stdout = full_run
    records = _records(root / "a.jsonl")
    _assert_loss_falls(records, 8, drop=0.5)
    for key in ("tokens_per_s", "lr", "grad_norm", "memory_mb", "eta_s"):
        assert key in records[8], key
    assert len(records[8]["memory_mb"]) == 2 and all(m > 0 for m in records[8]["memory_mb"])
    # 4 batch x 32 seq x 2 accum x 2 ranks
    assert "tokens/step = 4 batch x 32 seq x 2 accum x 2 dp ranks = 512" in stdout
    assert "step 8/8  loss" in stdout
    assert re.search(r"^done: steps 1-8 in .* tok/s, \S+ TFLOPS per rank$", stdout, re.M), stdout
    assert records[8]["tflops_per_rank"] > 0 and "mfu" not in records[8]  # no peak given
    pytest.importorskip("matplotlib")
    assert (root / "a.png").stat().st_size > 0


@pytest.mark.slow  # layout_run: the recipe on 4 ranks, per layout
@pytest.mark.parametrize("layout", LAYOUT_FLAGS)
def test_2d_recipe_loss_is_finite_and_falls(layout_run, layout):
    records = _records(layout_run(layout) / "a.jsonl")
    _assert_loss_falls(records, 6, drop=0.5)
    dp_ranks = {"hsdp": 4, "fsdp_tp": 2}[layout]  # TP peers share their batch
    assert records[1]["tokens"] == 4 * 32 * dp_ranks  # batch x seq x dp ranks, per step
    assert len(records[6]["memory_mb"]) == 4


@pytest.mark.slow  # full_run
def test_recipe_checkpoints_are_complete(full_run):
    root, _ = full_run
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == ["step-00000004", "step-00000008"]
    assert (root / "ckpt" / "step-00000008" / "fsdp2_complete.json").is_file()


@pytest.mark.slow  # full_run
def test_recipe_resume_reproduces_losses(full_run):
    # The resumed run is train() in the 2-rank test world: it must match the torchrun run exactly.
    root, _ = full_run
    _resume(root, 2, RUN_ARGS, step=4, steps=8)


@pytest.mark.slow  # full_run
def test_a_resumed_run_records_the_steps_an_uninterrupted_run_records(full_run, tmp_path):
    # Every 3rd step recorded: step 5, the first after resuming from 4, is printed, not recorded
    # (it was recorded too while the row's name shadowed the flag).
    root, _ = full_run
    shutil.copytree(root / "ckpt" / "step-00000004", tmp_path / "ckpt" / "step-00000004")
    metrics = tmp_path / "m.jsonl"
    run_on_ranks(_train_on_ranks, 2, [*RUN_ARGS, "--metrics.log_every=3", "--checkpoint-dir", str(tmp_path / "ckpt"),
                                      "--metrics-file", str(metrics)])
    assert sorted(_records(metrics)) == [6, 8]


@pytest.mark.slow  # layout_run
@pytest.mark.parametrize("layout", LAYOUT_FLAGS)
def test_2d_recipe_resume_reproduces_losses(layout_run, layout):
    _resume(layout_run(layout), 4, [*RUN_ARGS_2D, *LAYOUT_FLAGS[layout]], step=3, steps=6)


@pytest.mark.slow  # full_run and layout_run
@pytest.mark.parametrize("layout", EXPORTS)
def test_recipe_export_loads_into_unsharded_model(full_run, layout_run, layout):
    path = (full_run[0] if layout == "fsdp" else layout_run(layout)) / EXPORTS[layout]
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, weights_only=True)
    config = load_config(None, SMALL_MODEL)
    model = Transformer(config.model)
    model.load_state_dict(state)  # strict: every key, full shapes, no DTensors
    assert not any(isinstance(v, DTensor) for v in state.values())
    init = Transformer(config.model)
    init.init_weights(seed=0)
    assert not torch.equal(model.tok_embeddings.weight, init.tok_embeddings.weight), "export holds trained weights"


@pytest.mark.slow  # torchrun_runs: torchrun's start, tens of seconds on 2 cores
def test_config_error_under_torchrun_names_the_error_in_torchrun_report(torchrun_runs):
    # --training.lrr=1, rank 0 late: rank 1 fails first, and must not end the run (torchrun stops
    # every rank once one exits) before rank 0 has printed the line.
    proc = torchrun_runs[1]["config_error"]
    assert proc.returncode != 0
    error = "error: unknown key 'training.lrr' (from --training.lrr=1); did you mean 'training.lr'?"
    assert proc.stdout == ""
    assert proc.stderr.count(f"\n{error}") == 1, proc.stderr  # rank 0's line, once
    # torchrun's own failure report (its process, not ours) names it instead of a link to the docs.
    assert f"traceback : {error}" in proc.stderr
    assert "To enable traceback see" not in proc.stderr


def test_recipe_config_error_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--training.lrr=1"])  # fails before any process group starts
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: unknown key 'training.lrr' (from --training.lrr=1); did you mean 'training.lr'? "
        "keys in [training]: steps, batch_size, seq_len, grad_accum, lr, min_lr_ratio, warmup_steps, "
        "weight_decay, beta1, beta2, max_grad_norm, mixed_precision, activation_checkpoint, compile, seed, "
        "max_skipped_steps\n"
    )


# ---- the documented numbers ----------------------------------------------------------------------
GETTING_STARTED = REPO / "docs" / "getting-started.md"
DOC_CORPUS = "168 files, 4,698,555 bytes"  # Python 3.11.7's sources, as the sample output says


def test_first_steps_of_the_demo_print_the_documented_losses(tmp_path):
    # Steps 1-20 are the same on every machine (later ones depend on the CPU's kernels); the
    # learning rate warms up over 20 steps whatever training.steps is, so 20 steps suffice.
    text = GETTING_STARTED.read_text()
    assert f"data: {DOC_CORPUS} from the Python standard library" in text
    corpus = load_corpus(None)
    if f"{corpus.numel():,} bytes" != DOC_CORPUS.split(", ")[1]:
        pytest.skip(f"the documented losses are for Python 3.11.7's sources, not these {corpus.numel():,} bytes")
    documented = {int(m[1]): float(m[2]) for m in re.finditer(r"^step +(\d+)/300  loss (\d\.\d{4})", text, re.M)
                  if int(m[1]) <= 20}
    assert sorted(documented) == [1, 10, 20]
    run_on_ranks(_train_on_ranks, 2, ["--training.steps=20", "--metrics.sample_tokens=0", "--metrics.plot=false",
                                      "--metrics.peak_tflops=0.5", "--metrics-file", str(tmp_path / "m.jsonl")],
                 timeout=240.0)
    records = _records(tmp_path / "m.jsonl")
    assert {s: round(records[s]["loss"], 4) for s in documented} == documented
    # Throughput in model FLOPs: tokens/s x FLOPs per token / ranks, and its share of the given peak.
    flops = model_flops_per_token(Transformer(parse_args([]).model), parse_args([]))
    r = records[20]
    assert r["tflops_per_rank"] == pytest.approx(r["tokens_per_s"] * flops / 2 / 1e12)
    assert r["mfu"] == pytest.approx(r["tflops_per_rank"] / 0.5)


def test_flops_per_token_is_6n_plus_attention():
    config = parse_args([])  # the tiny config: dim 128, 4 layers, vocab 256, seq 128
    model = Transformer(config.model)
    n = sum(p.numel() for p in model.parameters())
    assert model_flops_per_token(model, config) == 6 * (n - 256 * 128) + 12 * 4 * 128 * 128
    tied = parse_args(["--model.tie_embeddings=true"])
    tied_model = Transformer(tied.model)
    assert model_flops_per_token(tied_model, tied) == 6 * sum(p.numel() for p in tied_model.parameters()) + \
        12 * 4 * 128 * 128


def test_ci_checks_the_documented_final_loss_range():
    # README and getting-started state the range .ci/run checks the Quickstart's step 300 against.
    low, high = re.search(r'^DEMO_LOSS_RANGE="(\S+) (\S+)"$', (REPO / ".ci" / "run").read_text(), re.M).groups()
    assert f"lands in {low}-{high}" in GETTING_STARTED.read_text()
    assert f"CI checks {low}-{high}" in (REPO / "README.md").read_text()


# ---- quiet output ------------------------------------------------------------------------------
def _without_numpy(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python processes cannot import numpy, as a virtualenv without it
    (a sitecustomize hides it: ``import numpy`` raises ImportError)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['numpy'] = None\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}


NUMPY_FREE_COMMANDS = {"train": [str(TRAIN), "--help"], "plan": ["-m", "fsdp2.plan", "--help"],
                       "checkpoint": ["-m", "fsdp2.checkpoint", "--help"]}


@pytest.fixture(scope="module")
def without_numpy_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every command of ``NUMPY_FREE_COMMANDS`` run once without numpy, all started together:
    each is one Python process importing torch on one core, so two run in the time of one."""
    env = _without_numpy(tmp_path_factory.mktemp("no_numpy"))
    return run_together({name: [sys.executable, *command] for name, command in NUMPY_FREE_COMMANDS.items()},
                        timeout=120, cwd=REPO, env=env)


@pytest.mark.parametrize("command", NUMPY_FREE_COMMANDS)
@pytest.mark.slow
def test_no_numpy_warning_without_numpy(without_numpy_runs, command):
    # torch warns "Failed to initialize NumPy" at import without numpy; neither needs numpy.
    proc = without_numpy_runs[command]
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
