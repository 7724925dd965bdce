"""``python -m fsdp2.plan --search``: the layouts it enumerates, sizes and ranks, and the recipe taking the winner.

- Enumeration: counted by hand on a small case; every layout is one the recipe's
  ``check_command`` accepts, with the same mesh, batch and policies (tiny model and 8B).
- Memory: ``FastMemory`` (one simulation per shape, the rest scaled over dp_shard) within 1% of
  ``estimate_memory``'s own simulation of each layout; the search's pruning (fastest first,
  stop at ``top``) gives what exhaustive evaluation of every layout gives.
- The CLI prints a ranked table, the winner's recipe flags, and a JSON the recipe's
  ``--layout-from`` reads (round trip through ``check_command``: no training).
- Errors name the fix.

Scored by ``toy_step``, an analytic stand-in written here (the step-time model is not this
test's subject): deterministic, and it depends on every field the search varies.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import random
import re
from pathlib import Path
from typing import Callable

import pytest
import torch

from fsdp2.plan import Layout, MemoryEstimate, ModelBuilder, Reserve, estimate_memory
from fsdp2.plan._search import PIPELINE_MIN_TORCH, FastMemory, _torch_version, enumerate_layouts, recipe_flags, search
from fsdp2.models.llama import LLAMA3, ModelArgs
from fsdp2.plan import main
from recipes.config import ConfigError
from recipes.llama.parallelize import fsdp_kwargs
from recipes.checks import check_command

ROOT = Path(__file__).resolve().parents[2]
TINY_TOML = str(ROOT / "recipes" / "configs" / "tiny.toml")
TINY = ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=128)  # tiny.toml's
SMALL = ModelArgs(dim=64, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=256, max_seq_len=16)
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class ToyStep:
    seconds: float
    tokens_per_s_per_device: float
    mfu: float
    limit: str


def toy_step(layout: Layout) -> ToyStep:
    """Compute split over tp x pp (recomputed a third more under AC), communication shrinking with
    quantization and growing with resharding (less to fewer ranks) and accumulation, a pipeline bubble."""
    tokens = layout.batch * layout.grad_accum * layout.seq
    compute = tokens / (layout.tp * layout.pp) * (4 / 3 if layout.activation_checkpointing else 1)
    reshard = {True: 2, False: 1}.get(layout.reshard_after_forward, 1.5)  # (an int: 1.5)
    comm = layout.grad_accum * reshard * (0.5 if layout.comm_policy else 1) \
        * (layout.dp_shard - 1) / layout.dp_shard * 40 + 30 * (layout.tp - 1) + 5 * (layout.dp_replicate - 1)
    bubble = compute * (layout.pp - 1) / max(1, layout.pp_microbatches)
    seconds = compute + comm + bubble
    parts = {"compute": compute, "communication": comm, "bubble": bubble}
    per_device = tokens * layout.dp_replicate * layout.dp_shard / layout.world / seconds
    return ToyStep(seconds, per_device, min(1.0, compute / seconds), max(parts, key=parts.__getitem__))


# ---- enumeration ---------------------------------------------------------------------------------
def test_enumeration_counted_by_hand():
    layouts = enumerate_layouts(SMALL, world=4, global_batch=4, seq=16, devices_per_node=4)
    # 2 blocks, 2 heads: tp in {1, 2}; pp in {1, 2 (1F1B, 2 microbatches; Interleaved1F1B needs 4 stages)}.
    # Policies: AC x reshard (2 x 2) x quantized (2, only where dp_shard x dp_replicate > 1).
    #   pp1 tp1: dp 4 -> dp_shard 2 (HSDP 2x2) or 4; 1 sequence each: batch 1   2 x 1 x 8 = 16
    #   pp1 tp2: dp 2 -> dp_shard 2; 2 sequences each: batch 1 or 2            1 x 2 x 8 = 16
    #   pp2 tp1: dp 2 -> dp_shard 2; batch 2 (a multiple of the 2 microbatches) 1 x 1 x 8 = 8
    #   pp2 tp2: dp 1 -> dp_shard 1; batch 2 or 4; nothing to quantize         1 x 2 x 4 = 8
    assert len(layouts) == 16 + 16 + 8 + 8
    assert len(set(map(repr, layouts))) == len(layouts)
    for lay in layouts:
        assert lay.batch * lay.grad_accum * lay.dp_replicate * lay.dp_shard == 4
    by_mesh = {}
    for lay in layouts:
        key = (lay.pp, lay.tp, lay.dp_replicate, lay.dp_shard)
        by_mesh[key] = by_mesh.get(key, 0) + 1
    assert by_mesh == {(1, 1, 2, 2): 8, (1, 1, 1, 4): 8, (1, 2, 1, 2): 16, (2, 1, 1, 2): 8, (2, 2, 1, 1): 8}
    # pp > 1 reshards as the recipe's "default" (nothing) or "always" (blocks and root)
    assert {(lay.reshard_after_forward, lay.root_reshard_after_forward) for lay in layouts if lay.pp > 1} == \
        {(False, False), (True, True)}
    # A node of 4 holds every shard axis here (dp_shard <= 4): resharding per node would be True
    # (dp_shard 4) or split a node (2), so it is not enumerated.
    assert not [lay for lay in layouts if not isinstance(lay.reshard_after_forward, bool)]
    # Nodes of 2: only FSDP 4 (pp1 tp1, dp_shard 4 = 2 nodes of 2) spans several whole nodes, and
    # takes per-node resharding (reshard_after_forward=2, unquantized: quantized weights refuse an
    # int) once per AC setting and micro-batch (1): 2 more than the 48 above. Nothing else changes
    # (tp still 1 or 2, which divide both node sizes).
    per_node = enumerate_layouts(SMALL, world=4, global_batch=4, seq=16, devices_per_node=2)
    assert len(per_node) == 48 + 2
    ints = [lay for lay in per_node if not isinstance(lay.reshard_after_forward, bool)]
    assert {(lay.dp_shard, lay.tp, lay.pp, lay.reshard_after_forward, lay.root_reshard_after_forward,
             lay.comm_policy) for lay in ints} == {(4, 1, 1, 2, False, None)}
    assert {lay.activation_checkpointing for lay in ints} == {False, True}
    assert {repr(lay) for lay in per_node} - {repr(lay) for lay in ints} == {repr(lay) for lay in layouts}


def _accepted(model_flags: list[str], lay: Layout) -> None:
    config, dims = check_command(model_flags + recipe_flags(lay), lay.world)
    t, p = config.training, config.parallelism
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.ep) == \
        (lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.ep)
    assert (t.batch_size, t.grad_accum, t.seq_len, t.activation_checkpoint) == \
        (lay.batch, lay.grad_accum, lay.seq, lay.activation_checkpointing)
    assert bool(p.quantize_weights) == bool(p.quantize_gradients) == (lay.comm_policy is not None)
    # What the recipe hands fully_shard for the blocks and the root (None: True for them, False for it).
    blocks, root = (fsdp_kwargs(config, pipelined=lay.pp > 1, root=r)["reshard_after_forward"] for r in (False, True))
    assert (True if blocks is None else blocks, bool(root)) == \
        (lay.reshard_after_forward, lay.root_reshard_after_forward)


def test_every_layout_is_accepted_by_the_recipe():
    layouts = enumerate_layouts(TINY, world=4, global_batch=16, seq=128, devices_per_node=4,
                                param_dtype=torch.float32)
    assert {lay.pp for lay in layouts} == ({1, 2, 4} if _torch_version() >= PIPELINE_MIN_TORCH else {1})
    for lay in layouts:
        _accepted(["--config", TINY_TOML], lay)


def test_per_node_layouts_are_accepted_by_the_recipe():
    # 8 ranks in nodes of 2: FSDP 8 and 4 (HSDP 2x4) span whole nodes and reshard per node (2).
    layouts = enumerate_layouts(TINY, world=8, global_batch=16, seq=128, devices_per_node=2,
                                param_dtype=torch.float32)
    ints = [lay for lay in layouts if not isinstance(lay.reshard_after_forward, bool)]
    assert {(lay.dp_replicate, lay.dp_shard) for lay in ints} == {(1, 8), (2, 4)}
    assert {lay.reshard_after_forward for lay in ints} == {2}
    for lay in ints:
        _accepted(["--config", TINY_TOML], lay)


def test_8b_layouts_are_accepted_by_the_recipe():
    layouts = enumerate_layouts(LLAMA3["llama3_8b"], world=64, global_batch=256, seq=8192)
    assert len(layouts) >= 200
    assert max(lay.tp for lay in layouts) == 8  # within a node of 8
    for lay in random.Random(0).sample(layouts, 60):
        _accepted(["--config", str(ROOT / "recipes" / "configs" / "llama3_8b.toml")], lay)


# ---- memory: shared simulations against each layout's own ------------------------------------------
@pytest.fixture(scope="module")
def helper():
    """A process forked from this one, to run half of a test's simulations while this one runs the
    other half: they are independent, and one process alone leaves the other core idle. (Meta
    tensors: no kernel runs; one thread.)"""
    with mp.get_context("fork").Pool(1, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        yield pool


def _simulate_job(job: tuple[Layout, ModelArgs, Reserve]) -> MemoryEstimate:
    lay, model, reserve = job
    return estimate_memory(lay, ModelBuilder.llama(model), reserve=reserve)


def _simulate_once(monkeypatch: pytest.MonkeyPatch, helper, model: ModelArgs,
                   jobs: list[tuple[Layout, Reserve]]) -> tuple[ModelBuilder, Callable[..., MemoryEstimate]]:
    """(``ModelBuilder.llama(model)``, ``estimate_memory`` of it with each layout simulated once and read
    back after, also where FastMemory calls it).

    The simulation is deterministic (test_shared_memory_simulates_two_shard_counts_and_fits_the_rest
    compares its results exactly), so repeating one proves nothing more; what FastMemory does with
    the results, and counts as simulations, is unchanged. ``jobs``, the (layout, reserve) the test
    will read, are simulated first (``estimate_memory`` itself), every second one by ``helper``."""
    builder = ModelBuilder.llama(model)
    every = [(lay, model, reserve) for lay, reserve in jobs]
    theirs = helper.map_async(_simulate_job, every[1::2], chunksize=1)
    estimates = [None] * len(every)
    estimates[::2] = [_simulate_job(job) for job in every[::2]]
    estimates[1::2] = theirs.get()
    done = {(repr(lay), reserve): est for (lay, reserve), est in zip(jobs, estimates)}

    def simulate(lay: Layout, built: ModelBuilder, *, reserve: Reserve) -> MemoryEstimate:
        assert built is builder, "one model per test"
        key = (repr(lay), reserve)
        if key not in done:
            done[key] = estimate_memory(lay, builder, reserve=reserve)
        return done[key]

    monkeypatch.setattr("fsdp2.plan._search.estimate_memory", simulate)
    return builder, simulate


def _shared_vs_full(monkeypatch: pytest.MonkeyPatch, helper, model: ModelArgs, layouts: list[Layout],
                    shapes: int) -> tuple[float, float]:
    """Worst relative errors of FastMemory against estimate_memory on layouts it did not simulate:
    (fitted from two simulations of the shape, scaled from one). Under ``_simulate_once``."""
    rng = random.Random(0)
    groups: dict[tuple, dict[int, Layout]] = {}
    for lay in layouts:
        shape = (lay.tp, lay.pp, lay.pp_schedule, lay.batch, lay.activation_checkpointing, lay.reshard_after_forward,
                 lay.comm_policy is not None, lay.grad_accum > 1)
        groups.setdefault(shape, {}).setdefault(lay.dp_shard, lay)
    varied = [list(g.values()) for g in groups.values() if len(g) >= 3]
    # Per shape: the two layouts FastMemory simulates (the one-simulation one's: the first) and one
    # it fits, whose own simulation is the reference.
    picked = [(first, second, rng.choice(others)) for first, second, *others in
              rng.sample(varied, min(shapes, len(varied)))]
    jobs = [(lay, Reserve()) for trio in picked for lay in trio]
    builder, simulate = _simulate_once(monkeypatch, helper, model, jobs)
    fitted = scaled = 0.0
    for first, second, lay in picked:
        fast, one = FastMemory(builder, Reserve()), FastMemory(builder, Reserve(), simulations_per_shape=1)
        assert fast.estimate(first)[2] == fast.estimate(second)[2] == one.estimate(first)[2] == "simulated"
        full = simulate(lay, builder, reserve=Reserve())
        peak, needed, how = fast.estimate(lay)
        assert how == "fitted"
        fitted = max(fitted, abs(needed / full.needed_bytes - 1), abs(peak / full.peak_bytes - 1))
        peak, needed, how = one.estimate(lay)
        assert how == "scaled"
        scaled = max(scaled, abs(needed / full.needed_bytes - 1))
    return fitted, scaled


@pytest.mark.slow
def test_shared_memory_matches_full_simulation_small(monkeypatch, helper):
    layouts = enumerate_layouts(TINY, world=16, global_batch=32, seq=128, devices_per_node=4)
    fitted, scaled = _shared_vs_full(monkeypatch, helper, TINY, layouts, shapes=8)
    assert fitted < 0.01 and scaled < 0.05  # (the search prunes by the scaled one only beyond a 10% margin)


@pytest.mark.slow
def test_shared_memory_matches_full_simulation_8b(monkeypatch, helper):
    layouts = enumerate_layouts(LLAMA3["llama3_8b"], world=64, global_batch=128, seq=8192)
    fitted, scaled = _shared_vs_full(monkeypatch, helper, LLAMA3["llama3_8b"], layouts, shapes=3)
    assert fitted < 0.01 and scaled < 0.05


def test_shared_memory_simulates_two_shard_counts_and_fits_the_rest():
    builder = ModelBuilder.llama(SMALL)
    fast = FastMemory(builder, Reserve.none())
    fsdp8, hsdp2x4, hsdp4x2 = (Layout(world=8, batch=2, seq=16, dp_replicate=r) for r in (1, 2, 4))
    full = {r: estimate_memory(lay, builder, reserve=Reserve.none()).peak_bytes
            for r, lay in ((1, fsdp8), (2, hsdp2x4), (4, hsdp4x2))}
    assert fast.estimate(fsdp8) == (full[1], full[1], "simulated")
    assert fast.estimate(hsdp2x4) == (full[2], full[2], "simulated")
    peak, needed, how = fast.estimate(hsdp4x2)  # dp_shard 2: from the two, not simulated
    assert how == "fitted" and fast.simulations == 2 and peak == needed
    # the step's peak moves (from the second block's backward to the first's) and is still found
    assert abs(peak / full[4] - 1) < 0.001
    # With one simulation, only the parameters' shards and optimizer state at its peak are rescaled:
    # coarser on a model this small, whose sharded gradients and buffers in flight weigh as much.
    one = FastMemory(builder, Reserve.none(), simulations_per_shape=1)
    one.estimate(fsdp8)
    assert abs(one.estimate(hsdp4x2)[0] / full[4] - 1) < 0.03


@pytest.mark.slow
def test_pruning_agrees_with_exhaustive_evaluation(monkeypatch, helper):
    # Nodes of 2: the per-node layouts (FSDP 4 resharding to 2 ranks) are among them.
    layouts = enumerate_layouts(SMALL, world=4, global_batch=4, seq=16, devices_per_node=2)
    # (the searches' simulations of these layouts: read back)
    builder, simulate = _simulate_once(monkeypatch, helper, SMALL, [(lay, Reserve.none()) for lay in layouts])
    needed = {repr(lay): simulate(lay, builder, reserve=Reserve.none()).needed_bytes for lay in layouts}
    budget = sorted(needed.values())[len(needed) // 2]  # half of them fit
    result = search(layouts, score=toy_step, memory=FastMemory(builder, Reserve.none()), gpu_memory=budget, top=5)
    exhaustive = [e.layout for e in result.evaluated if needed[repr(e.layout)] <= budget]  # same score order
    assert [e.layout for e in result.ranked] == exhaustive[:5]
    assert result.simulations < len(layouts)  # it pruned
    every = search(layouts, score=toy_step, memory=FastMemory(builder, Reserve.none()), gpu_memory=budget, top=5,
                   exhaustive=True)
    assert {repr(e.layout): e.fits for e in every.evaluated} == {k: v <= budget for k, v in needed.items()}


# ---- the command line and the recipe -----------------------------------------------------------
SEARCH = ["--search", "--config", TINY_TOML, "--world", "4", "--global-batch", "16", "--seq", "128",
          "--hardware", "a100"]


def test_cli_prints_a_ranked_table_and_the_recipe_takes_the_winner(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    assert main(SEARCH + ["--top", "3", "--search-json", str(plan)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("#"))
    for column in ("layout", "AC", "reshard", "batch x accum", "tokens/s/device", "MFU", "needed/rank", "limited by"):
        assert column in header
    rows = [line for line in out.splitlines() if re.match(r"^[1-9] ", line)]
    assert len(rows) == 3
    speeds = [float(re.search(r"  ([0-9,]+)  ", row)[1].replace(",", "")) for row in rows]
    assert speeds == sorted(speeds, reverse=True)
    command = next(line for line in out.splitlines() if "recipes/train.py" in line and "torchrun" in line)
    saved = json.loads(plan.read_text())
    best = saved["layouts"][0]
    assert best["rank"] == 0 and best["fits"] and best["memory"] in ("simulated", "fitted")
    assert sum(e["rank"] is not None for e in saved["layouts"]) == 3
    assert len(saved["layouts"]) == len(enumerate_layouts(TINY, world=4, global_batch=16, seq=128,
                                                         param_dtype=torch.float32))
    # The printed flags and --layout-from give the recipe the same configuration.
    printed, _ = check_command(command.split("recipes/train.py ", 1)[1].split(), 4)
    config, dims = check_command(["--config", TINY_TOML, "--layout-from", str(plan)], 4)
    assert config == printed
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == tuple(
        best["layout"][k] for k in ("dp_replicate", "dp_shard", "tp", "pp"))
    second, _ = check_command(["--config", TINY_TOML, "--layout-from", f"{plan}:2"], 4)
    assert second.training.batch_size == saved["layouts"][2]["layout"]["batch"]
    # An override after --layout-from wins; the layout is the plan's otherwise.
    seeded, _ = check_command(["--config", TINY_TOML, "--layout-from", str(plan), "--training.seed=7"], 4)
    assert seeded.training.seed == 7 and seeded.parallelism == config.parallelism


def test_hardware_file_reaches_the_scorer_and_the_enumeration(capsys, tmp_path):
    # Nodes of 2 devices with 8 GiB: tensor parallelism stays within 2, the memory is the profile's.
    fields = {"name": "node2", "peak_flops": 1e14, "hbm_bandwidth": 1e12, "devices_per_node": 2,
              "intra_bandwidth": 1e11, "intra_latency": 1e-5, "inter_bandwidth": 1e10, "inter_latency": 2e-5,
              "memory": 8 * 2**30}
    (tmp_path / "node2.json").write_text(json.dumps(fields))
    plan = tmp_path / "plan.json"
    assert main(SEARCH[:-1] + [str(tmp_path / "node2.json"), "--top", "1", "--search-json", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "8.00 GiB per device" in out and "(node2)" in out and "--nproc-per-node 2 " in out
    saved = json.loads(plan.read_text())
    assert saved["hardware"] == "node2" and saved["gpu_memory"] == 8 * 2**30
    assert max(e["layout"]["tp"] for e in saved["layouts"]) == 2
    # Two nodes of 2: FSDP 4 reshards per node too, and --layout-from hands the recipe the int.
    k, entry = next((k, e) for k, e in enumerate(saved["layouts"]) if e["layout"]["reshard_after_forward"] == 2)
    assert entry["layout"]["dp_shard"] == 4 and entry["recipe"]["parallelism.reshard_after_forward"] == 2
    config, dims = check_command(["--config", TINY_TOML, "--layout-from", f"{plan}:{k}"], 4)
    assert config.parallelism.reshard_after_forward == 2 and dims.dp_shard == 4
    assert fsdp_kwargs(config)["reshard_after_forward"] == 2


def test_layout_from_refuses_another_world_or_model_or_entry(tmp_path):
    plan = tmp_path / "plan.json"
    assert main(SEARCH + ["--top", "1", "--search-json", str(plan)]) == 0
    with pytest.raises(ConfigError, match=r"planned for 4 ranks and this run has 8 .*launch 4 ranks or search again "
                                          r"with --world 8"):
        check_command(["--config", TINY_TOML, "--layout-from", str(plan)], 8)
    with pytest.raises(ConfigError, match=r"planned for another model .*dim 256 \(planned: 128\).*give the --config"):
        check_command(["--config", TINY_TOML, "--model.dim=256", "--layout-from", str(plan)], 4)
    entries = len(json.loads(plan.read_text())["layouts"])
    with pytest.raises(ConfigError, match=rf"holds layouts 0-{entries - 1}; give FILE:K"):
        check_command(["--config", TINY_TOML, "--layout-from", f"{plan}:{entries}"], 4)
    with pytest.raises(ConfigError, match=r"cannot read"):
        check_command(["--layout-from", str(tmp_path / "missing.json")], 4)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"not the JSON of python -m fsdp2.plan --search"):
        check_command(["--layout-from", str(tmp_path / "other.json")], 4)


def test_search_errors_name_the_fix(capsys):
    def error(*argv: str) -> str:
        with pytest.raises(SystemExit):
            main(list(argv))
        return capsys.readouterr().err

    assert re.search(r"--global-batch 3 sequences cannot be split evenly .*\(world / \(pp x tp\): 1, 2, 4\); "
                     r"give a global batch that one of them divides, e.g. 4",
                     error(*SEARCH[:6], "3", *SEARCH[7:]))
    assert re.search(r"no layout of 4 ranks fits in 1.00 MiB: the closest, .* needs at least .*its reserve alone",
                     error(*SEARCH, "--gpu-memory", "1MiB"))
    one = ["--search", "--dim", "64", "--n-layers", "2", "--n-heads", "2", "--vocab-size", "256", "--seq", "16",
           "--world", "1", "--global-batch", "2", "--no-reserve", "--gpu-memory", "64KiB"]  # 8 layouts, all sized
    assert re.search(r"no layout of 1 ranks fits in 64.00 KiB: the closest, FSDP 1 \(activation checkpointing "
                     r"(none|full), micro-batch [12]\), needs [0-9.]+ MiB \([0-9.]+ MiB over\); add ranks", error(*one))
    assert "--world: expected a positive integer, got '0'" in error(*SEARCH[:4], "0", *SEARCH[5:])
    assert "--search needs --global-batch" in error(*SEARCH[:5], *SEARCH[7:])
    assert re.search(r"hardware 'b200': not a preset \(a100, h100, h100_96gb_500w, h200\) nor a JSON file",
                     error(*SEARCH[:-1], "b200"))
    with pytest.raises(ValueError, match=r"world \(0\), global batch \(4\) and seq \(16\) must be at least 1"):
        enumerate_layouts(SMALL, world=0, global_batch=4, seq=16)
