"""torchtitan's published runs predicted (issue #39 item 3), and selective activation checkpointing.

- docs/planning.md's "Published runs" tables are what ``benchmarks/published_runs.py`` computes
  now (regenerated and compared cell by cell, figures within a small tolerance): the time
  columns in the quick run, the memory columns (four 8B simulations) in the slow one.
- ``Layout.selective_checkpointing``: its errors; the step-time model's recomputation for "layer"
  (every second block's forward) and "op" (the forward but attention and the 1st, 3rd, ... matmul,
  picked here by the ops reading parameters) against hand sums of the recorded ops; the planner
  simulates "op" between no checkpointing and full, byte for byte as a tracked run on 2 gloo
  ranks with the same policy, and refuses "layer".
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp2.plan import HARDWARE, Layout, ModelBuilder, Reserve, estimate_memory, model_costs, predict_step_time
from fsdp2.plan._steptime import _compute
from fsdp2.models.llama import ModelArgs

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "planning.md"
SMALL = ModelArgs(dim=256, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=1024, max_seq_len=512)


def _bench():
    spec = importlib.util.spec_from_file_location("published_runs", REPO / "benchmarks" / "published_runs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("published_runs", module)
    spec.loader.exec_module(module)
    return module


def _doc_table(first_header: str) -> list[list[str]]:
    """The rows (cells) of the docs' table whose header starts with ``first_header``."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


_NUMBER = re.compile(r"[-+]?\d[\d,]*\.?\d*")


def _same(doc: str, now: str) -> bool:
    """Equal text, and each figure within 1% (or 0.3 for percentages and errors)."""
    if _NUMBER.sub("#", doc) != _NUMBER.sub("#", now):
        return False
    for a, b in zip(_NUMBER.findall(doc), _NUMBER.findall(now)):
        x, y = float(a.replace(",", "")), float(b.replace(",", ""))
        if abs(x - y) > max(0.3, 0.01 * abs(y)):
            return False
    return True


def _compare(markdown: str, columns: slice) -> None:
    header = markdown.splitlines()[0]
    now = [[c.strip() for c in line.strip("|").split("|")] for line in markdown.splitlines()[2:]]
    doc = _doc_table(header)
    assert len(doc) == len(now), f"docs/planning.md has {len(doc)} rows under {header!r}, the code {len(now)}"
    for d, n in zip(doc, now):
        for a, b in zip(d[columns], n[columns]):
            assert _same(a, b), (f"docs/planning.md's published-runs row {d[0]!r}: {a!r}, now {b!r}; regenerate "
                                 "with python benchmarks/published_runs.py --markdown")


def test_docs_time_columns_are_what_the_model_predicts_now():
    bench = _bench()
    predictions = [bench.predict(run, memory=False) for run in bench.RUNS]
    _compare(bench.markdown(predictions), slice(0, 11))  # up to the published memory
    _compare(bench.markdown_400g(predictions), slice(None))
    summary = bench.summary(predictions)
    prose = " ".join(DOC.read_text().split())
    stated = f"TPS meets it on {summary['tps_within_20pct']} of {summary['rows']} rows"
    assert stated in prose, f"docs/planning.md's published runs should say {stated!r}"


@pytest.mark.slow  # four 8B simulations: about 10 s alone, more on a loaded machine
def test_docs_memory_columns_are_what_the_planner_simulates_now():
    bench = _bench()
    predictions = [bench.predict(run) for run in bench.RUNS]
    _compare(bench.markdown(predictions), slice(None))
    assert all(p["memory_gib"] is not None for run, p in zip(bench.RUNS, predictions) if run.memory_gib)
    summary = bench.summary(predictions)
    stated = f"memory meets it on all {summary['memory_rows']} rows" if summary["memory_within_10pct"] == \
        summary["memory_rows"] else f"memory meets it on {summary['memory_within_10pct']} of {summary['memory_rows']}"
    assert stated in " ".join(DOC.read_text().split()), f"docs/planning.md's published runs should say {stated!r}"


def test_selective_checkpointing_errors():
    with pytest.raises(ValueError, match="selective_checkpointing must be None, 'op' or 'layer'"):
        Layout(world=8, batch=1, seq=64, selective_checkpointing="selective")
    with pytest.raises(ValueError, match="exclude each other"):
        Layout(world=8, batch=1, seq=64, selective_checkpointing="op", activation_checkpointing=True)
    with pytest.raises(ValueError, match="does not simulate selective_checkpointing='layer'"):
        estimate_memory(Layout(world=8, batch=1, seq=64, selective_checkpointing="layer"), ModelBuilder.llama(SMALL))


def _recomputed(layout: Layout, costs) -> float:
    hw = HARDWARE["h100"]
    return predict_step_time(layout, costs, hw).recompute


def test_selective_recompute_against_hand_sums():
    builder = ModelBuilder.llama(SMALL)
    base = Layout(world=8, batch=2, seq=512, param_dtype=torch.bfloat16)
    costs = model_costs(base, builder)
    hw = HARDWARE["h100"]
    forward = _compute(costs.block_forward, 2, 1, hw)
    n = costs.n_blocks
    assert _recomputed(base, costs) == 0.0
    full = _recomputed(dataclasses.replace(base, activation_checkpointing=True), costs)
    assert full == pytest.approx(n * forward)
    layer = _recomputed(dataclasses.replace(base, selective_checkpointing="layer"), costs)
    assert layer == pytest.approx((n // 2) * forward)
    # Llama's block: q, k, v projections, attention, output projection, w1, w3, w2.
    matmuls = [i for i, op in enumerate(costs.block_forward) if op.weight_bytes and op.flops]
    attention = [i for i, op in enumerate(costs.block_forward) if op.attention]
    assert len(matmuls) == 7 and len(attention) == 1
    saved = set(matmuls[0::2]) | set(attention)
    kept = tuple(op for i, op in enumerate(costs.block_forward) if i not in saved)
    op = _recomputed(dataclasses.replace(base, selective_checkpointing="op"), costs)
    assert op == pytest.approx(n * _compute(kept, 2, 1, hw))
    assert 0 < op < full and op != layer


def test_selective_op_memory_between_none_and_full():
    builder = ModelBuilder.llama(SMALL)
    base = Layout(world=4, batch=2, seq=512, param_dtype=torch.bfloat16)
    peaks = {name: estimate_memory(dataclasses.replace(base, **kw), builder, reserve=Reserve.none())
             for name, kw in {"none": {}, "full": {"activation_checkpointing": True},
                              "op": {"selective_checkpointing": "op"}}.items()}
    acts = {name: e.peak_by_category["activations"] for name, e in peaks.items()}
    assert acts["full"] < acts["op"] < acts["none"], acts
    assert "selective op" in peaks["op"].layout


# The recipe's model, small, its vocabulary too (so the blocks' saved activations, not the logits, make the peak).
_RECIPE = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64)


def _track_selective_op():
    """This rank's tracked second step of the recipe's model, each block under the op-level policy."""
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    from benchmarks.memory import build, train_step
    from fsdp2.memory import MemoryTracker
    from fsdp2.plan._selective import op_level_contexts
    from recipes.llama.model import ModelArgs
    from tests._dist import environ

    with environ("FSDP2_CPU_COLLECTIVES", "auto"):  # the transport the planner is told to plan
        model, _dims = build(ModelArgs(**_RECIPE), torch.bfloat16, True, False)
        for b in model.layers:
            b.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False,
                                                              context_fn=op_level_contexts(contextlib.nullcontext()),
                                                              **k))(b.forward)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(dist.get_rank())
        train_step(model, opt, gen, 2, 64)
        with MemoryTracker(model, opt) as tracker:
            train_step(model, opt, gen, 2, 64)
    return tracker.report


_PLAN_SELECTIVE_OP = """
import pickle, sys, torch
from benchmarks.memory import _inputs
from fsdp2.plan import Layout, ModelBuilder, estimate_memory
from recipes.llama.model import ModelArgs, Transformer
from tests.tools.test_published_runs import _RECIPE
layout = Layout(world=2, batch=2, seq=64, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                backend="gloo", selective_checkpointing="op")
est = estimate_memory(layout, ModelBuilder(build=lambda: Transformer(ModelArgs(**_RECIPE)), make_inputs=_inputs))
sys.stdout.buffer.write(pickle.dumps(est))
"""


@pytest.mark.slow  # two gloo ranks train two steps, then the planner simulates
def test_selective_op_planner_matches_a_tracked_run():
    from benchmarks.memory import compare
    from tests._dist import run_on_ranks

    # The planner plans the transport FSDP2_CPU_COLLECTIVES asks for now, the run takes it when its
    # groups are built: both told "auto", whatever an earlier test left in this process. The
    # planner's process starts first and runs while the ranks train (neither waits on the other).
    env = {**os.environ, "FSDP2_CPU_COLLECTIVES": "auto"}
    planner = subprocess.Popen([sys.executable, "-c", _PLAN_SELECTIVE_OP], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=REPO, env=env)
    try:
        measured = run_on_ranks(_track_selective_op, 2)[0]
        out, err = planner.communicate(timeout=300)
    finally:
        if planner.poll() is None:  # the ranks failed, or the planner hung
            planner.kill()
            planner.communicate()
    assert planner.returncode == 0, err.decode()
    est = pickle.loads(out)
    rows = compare(measured, est)
    # The same bytes as the tracked run, peak and activations (full checkpointing would plan about
    # a quarter fewer activations here, none about half more).
    assert rows["total"]["planner"] == rows["total"]["tracker"], (str(measured), str(est))
    assert rows["activations"]["planner"] == rows["activations"]["tracker"], (str(measured), str(est))
    assert all(row["ok"] for row in rows.values()), rows
