"""benchmarks/plan_accuracy.py runs end to end (``--quick``: 2 layouts of 3 steps on 2 CPU ranks)
and ends with its JSON line. Its figures are timings: none is asserted, only their presence."""

from __future__ import annotations

import json

import pytest

from benchmarks.plan_accuracy import spearman


def test_spearman_by_hand():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)  # 1 - 6 x 2 / (3 x 8)


@pytest.mark.slow
def test_quick_run_ends_with_the_json_line(tmp_path, monkeypatch, capsys):
    # The script is ``main()`` under ``if __name__ == "__main__"``: main(argv) here runs the same
    # calibration (spawned ranks), torchrun launches and table, without an interpreter's torch import.
    from benchmarks.plan_accuracy import main

    monkeypatch.chdir(tmp_path)
    main(["--quick"])
    stdout = capsys.readouterr().out
    lines = stdout.strip().splitlines()
    result = json.loads(lines[-1])
    for key in ("spearman", "median_abs_error", "best_gap", "transport", "torch", "worlds", "rows"):
        assert key in result, key
    assert len(result["rows"]) == 2 and result["worlds"] == [2]
    for row in result["rows"]:
        assert {"layout", "predicted_s", "measured_s", "error"} <= set(row)
        assert row["layout"] in stdout.split(lines[-1])[0]  # the table lists every row


def _args(*argv):
    from benchmarks.plan_accuracy import build_parser
    return build_parser().parse_args(list(argv))


def test_gpu_layouts_at_toy_size_for_cpu():
    """``--device cpu --gpu-layouts``: the GPU layouts' flags with a toy model in fp32 (bf16 matmuls
    crawl on most CPUs); ``--device cuda`` keeps them as they are."""
    from benchmarks.plan_accuracy import GPU_LAYOUTS, _layouts
    toy = _layouts(_args("--gpu-layouts"))
    assert len(toy) == len(GPU_LAYOUTS)
    for (name, world, flags), (gpu_name, _, gpu_flags) in zip(toy, GPU_LAYOUTS):
        assert name == f"toy {gpu_name}" and world == 1
        assert "--model.dim=64" in flags and "--training.mixed_precision=bf16" not in flags
        kept = [f for f in gpu_flags if not f.startswith(("--model.", "--training.seq_len=", "--training.mixed"))]
        assert kept and all(f in flags for f in kept)  # batch, checkpointing: as the GPU layout's
    assert _layouts(_args("--device", "cuda")) == GPU_LAYOUTS


def test_gpu_layouts_are_predicted_from_a_preset():
    """Each GPU layout's recipe flags become a planner layout the h200 preset prices: a larger
    batch of one model takes longer, checkpointing adds its recomputation."""
    from benchmarks.plan_accuracy import GPU_LAYOUTS, predict
    from fsdp2.plan import load_hardware
    h200 = load_hardware("h200")
    seconds = {name: predict(flags, world, h200, "cuda") for name, world, flags in GPU_LAYOUTS}
    assert seconds["2048x16 b1"] < seconds["2048x16 b2"] < seconds["2048x16 b4"] < seconds["2048x16 b4 ac"]
    assert seconds["4096x4 b1"] < seconds["4096x4 b2"] < seconds["4096x4 b4 ac"]
    # b4 on the 16-block model: ~0.9B parameters x 8192 tokens x 6 FLOPs at 692 TFLOP/s is ~65 ms
    # of matmuls; attention, the output layer and the optimizer add to it, not orders of magnitude
    assert 0.06 < seconds["2048x16 b4"] < 0.3


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_device_cuda_without_a_gpu_is_refused():
    from benchmarks.plan_accuracy import main
    with pytest.raises(SystemExit, match="--device cuda but torch sees no GPU"):
        main(["--device", "cuda"])
