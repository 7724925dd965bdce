"""benchmarks/quantized_comm.py end to end: 2 ranks under torchrun, a few steps of each run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "quantized_comm.py"
KEYS = {"bytes_ratio_weights", "bytes_ratio_both", "final_loss_off", "final_loss_weights", "final_loss_both",
        "bytes_per_step", "bf16_bytes_per_step", "config", "final_loss_rel_both", "final_loss_rel_by_seed_both",
        "across_nodes_per_step"}


@pytest.mark.slow  # torchrun's start and six short trainings: about 20 s on 2 cores
def test_quantized_comm_benchmark_reports_fewer_bytes_and_close_losses(tmp_path):
    out = tmp_path / "qc.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(BENCH),
           "--steps", "3", "--seeds", "0,1", "--val-batches", "2", "--runs", "off,weights,both", "--out", str(out),
           # The tiny config, smaller: 2 of its 8 sequences a rank and 64 of its 128 bytes each (the same
           # bytes sent, less compute), 2 of its 4 blocks (the same kinds of parameters sent, half as many).
           "--set", "training.batch_size=2", "--set", "training.seq_len=64", "--set", "model.n_layers=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert KEYS <= summary.keys(), summary
    sent = summary["bytes_per_step"]
    assert sent["off"] > sent["weights"] > sent["both"] > 0, sent
    assert 0 < summary["bytes_ratio_both_vs_off"] < summary["bytes_ratio_weights_vs_off"] < 1
    # fp32 all-gathers and reduce-scatters: bf16 everywhere is about half of them
    assert summary["bf16_bytes_per_step"] == pytest.approx(sent["off"] / 2, rel=0.02)
    for name in ("weights", "both"):  # the issue's ratios: against bf16's bytes
        assert summary[f"bytes_ratio_{name}"] == pytest.approx(sent[name] / summary["bf16_bytes_per_step"], abs=1e-4)
    assert summary["across_nodes_per_step"] == {"off": 0, "weights": 0, "both": 0}  # one torchrun: one node
    for name in ("off", "weights", "both"):
        assert summary[f"final_loss_{name}"] == pytest.approx(summary["final_loss_off"], rel=0.01)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(line.get("run"), line.get("seed")) for line in lines] == [
        ("off", 0), ("weights", 0), ("both", 0), ("off", 1), ("weights", 1), ("both", 1), (None, None)]
    assert all(len(line["losses"]) == 3 and list(line["val_losses"]) == ["3"] for line in lines[:6])
    assert lines[0]["losses"] != lines[3]["losses"]  # the seeds differ
    assert lines[6] == summary
    # the summary's means, from the per-seed lines
    val = {(line["run"], line["seed"]): line["val_losses"]["3"] for line in lines[:6]}
    assert summary["final_loss_both"] == pytest.approx((val["both", 0] + val["both", 1]) / 2, abs=1e-5)
    rel = [val["both", s] / val["off", s] - 1 for s in (0, 1)]
    assert summary["final_loss_rel_by_seed_both"] == pytest.approx(rel, abs=1e-5)
    assert summary["final_loss_rel_both"] == pytest.approx(sum(rel) / 2, abs=1e-5)


def test_quantized_comm_benchmark_refuses_bad_arguments_before_training():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import quantized_comm
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    args = quantized_comm.build_parser().parse_args(["--block-size", "0"])
    with pytest.raises(ValueError, match=r"parallelism.quantize_block_size must be > 0, got 0"):
        quantized_comm.measure(args)
