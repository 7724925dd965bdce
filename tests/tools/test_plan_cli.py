"""The planner's verdict is honest: what a GPU process holds besides the step, units, help, any model, suggestions.

- ``Reserve``: the CUDA context, NCCL's buffers per communicator and the caching allocator's
  fragmentation are added to the simulated peak before "fits"; the numbers are stated
  defaults, overridable, and nothing for CPU (gloo) layouts. A layout that fits by its peak
  alone (the issue's Llama-3-8B on 8 x 80 GB without activation checkpointing, 99%) does not
  once the reserve is counted.
- ``--gpu-memory 80GB`` is 80 GiB, as GPU makers count (an "80 GB" GPU holds 80 GiB), and the
  output says how it was read; a size without a unit is refused.
- ``--help`` shows every default; ``--activation-checkpointing full`` is accepted.
- Custom dimensions and a Hugging Face ``config.json`` give exactly the preset's numbers when
  they describe the same model.
- A layout that does not fit gets the nearest ones that do, and each suggested one does fit.

The CLI runs in this process (``main``): no process group here, as the planner's TP needs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from fsdp2.plan import Layout, ModelBuilder, Reserve, estimate_memory
from fsdp2.models.llama import LLAMA3, ModelArgs
from fsdp2.plan import RESERVE_DEFAULTS, main, parse_bytes

GiB, MiB = 2**30, 2**20
SMALL = ["--dim", "256", "--n-layers", "4", "--n-heads", "4", "--n-kv-heads", "2", "--vocab-size", "1024",
         "--seq", "256", "--batch", "4"]


def _plan(capsys, *args: str) -> str:
    assert main(list(args)) == 0
    return capsys.readouterr().out


def _needed(out: str) -> int:
    match = re.search(r"^needed +([0-9.]+) (MiB|GiB)", out, re.M) or re.search(r"^total +([0-9.]+) (MiB|GiB)", out,
                                                                             re.M)
    return round(float(match[1]) * {"MiB": MiB, "GiB": GiB}[match[2]])


# ---- the reserve ----------------------------------------------------------------------------------
def test_reserve_defaults_are_stated_and_added_to_the_peak():
    assert (Reserve().context, Reserve().nccl_per_group, Reserve().fragmentation) == (GiB, 512 * MiB, 0.10)
    assert {k: parse_bytes(v) for k, v in RESERVE_DEFAULTS.items()} == {"context": GiB, "nccl_per_group": 512 * MiB}
    # One communicator per mesh axis of 2+ ranks: HSDP x TP has three.
    hsdp_tp = Layout(world=16, batch=1, seq=8, dp_replicate=2, tp=2)
    assert Reserve().bytes(hsdp_tp, 1000 * MiB) == {"CUDA context": GiB, "NCCL (3 communicators)": 1536 * MiB,
                                                    "allocator (10% of total)": 100 * MiB}
    assert Reserve.none().bytes(hsdp_tp, 1000 * MiB) == {}
    with pytest.raises(ValueError, match=r"Reserve.fragmentation must be a fraction in \[0, 1\), got 1.5"):
        Reserve(fragmentation=1.5)
    with pytest.raises(ValueError, match=r"Reserve.context must be a number of bytes >= 0, got -1"):
        Reserve(context=-1)


def test_reserve_decides_fits_and_cpu_layouts_reserve_nothing():
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=16)
    layout = Layout(world=2, batch=1, seq=16)
    bare = estimate_memory(layout, ModelBuilder.llama(args), reserve=Reserve.none())
    gpu = estimate_memory(layout, ModelBuilder.llama(args), gpu_memory=bare.peak_bytes + MiB)
    assert gpu.peak_bytes == bare.peak_bytes, "the reserve never changes the simulated step"
    assert gpu.needed_bytes == bare.peak_bytes + GiB + 512 * MiB + int(0.1 * bare.peak_bytes)
    assert gpu.fits is False and "does NOT fit in" in gpu.table() and "+ CUDA context" in gpu.table()
    assert estimate_memory(layout, ModelBuilder.llama(args), gpu_memory=bare.peak_bytes + MiB,
                           reserve=Reserve.none()).fits is True
    cpu = estimate_memory(Layout(world=2, batch=1, seq=16, backend="gloo"), ModelBuilder.llama(args))
    assert cpu.reserved == {} and cpu.needed_bytes == cpu.peak_bytes


def test_llama3_8b_without_checkpointing_no_longer_fits_80gb(capsys):
    # The issue: 79.16 GiB of simulated peak was "fits (99%)" on an 80 GB GPU. Since the root keeps
    # its parameters to the end of backward (issue 26) the peak is 80.14 GiB; the reserve still
    # decides between "fits" on the peak alone and "does NOT fit" (here on an 81 GiB GPU).
    out = _plan(capsys, "--config", "llama3_8b", "--world", "8", "--gpu-memory", "80GB")
    assert re.search(r"^total +80.14 GiB", out, re.M)
    assert "does NOT fit in 80.00 GiB: needs 89.66 GiB (112%)" in out
    assert "note: --gpu-memory 80GB read as 80.00 GiB (GB as GPU makers count" in out
    assert "nearest layouts that fit (each from this one):\n  --activation-checkpointing full: needs" in out
    bare = _plan(capsys, "--config", "llama3_8b", "--world", "8", "--gpu-memory", "81GiB", "--no-reserve")
    assert "fits in 81.00 GiB: needs 80.14 GiB (99%)" in bare and "note:" not in bare
    reserved = _plan(capsys, "--config", "llama3_8b", "--world", "8", "--gpu-memory", "81GiB")
    assert "does NOT fit in 81.00 GiB: needs 89.66 GiB (111%)" in reserved


# ---- units, help, flags ---------------------------------------------------------------------------
def test_sizes_read_gb_as_gpu_makers_do_and_need_a_unit():
    assert parse_bytes("80GB") == parse_bytes("80GiB") == parse_bytes("80 gib") == 80 * GiB
    assert parse_bytes("512MB") == 512 * MiB and parse_bytes("1.5TiB") == 1536 * GiB
    assert parse_bytes("85899345920B") == 80 * GiB
    for bad in ("80", "lots", "80GiBs"):
        with pytest.raises(Exception, match=rf"cannot read '{bad}' as a size; sizes take a unit"):
            parse_bytes(bad)


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("tokens per sequence (default: 8192)", "(default: 1GiB)", "(default: 512MiB)",
                    "(default: 0.1)", "(default: bf16)", "(default: none)", "(default: adamw)"):
        assert default in text, default
    assert "GB/MB/TB read the same (binary" in text


def test_activation_checkpointing_takes_full_or_none(capsys):
    full = _plan(capsys, *SMALL, "--world", "2", "--activation-checkpointing", "full")
    assert "activation_checkpointing=True" in full
    assert _plan(capsys, *SMALL, "--world", "2", "--activation-checkpointing", "true") == full
    assert "activation_checkpointing=False" in _plan(capsys, *SMALL, "--world", "2", "--activation-checkpointing",
                                                     "none")
    with pytest.raises(SystemExit):
        main([*SMALL, "--world", "2", "--activation-checkpointing", "selective"])
    assert "selective (per-op) activation checkpointing is not modeled" in capsys.readouterr().err


# ---- any model ------------------------------------------------------------------------------------
def _dims_of(name: str) -> list[str]:
    a = LLAMA3[name]
    return ["--dim", str(a.dim), "--n-layers", str(a.n_layers), "--n-heads", str(a.n_heads), "--n-kv-heads",
            str(a.n_kv_heads), "--vocab-size", str(a.vocab_size), "--ffn-hidden", str(a.ffn_hidden),
            "--max-seq-len", str(a.max_seq_len)]


def _body(out: str) -> str:
    """The output without its first line's model name."""
    return out.split(":", 1)[1]


def test_custom_dimensions_and_hf_config_match_the_preset(capsys, tmp_path):
    layout = ["--world", "8", "--seq", "1024", "--gpu-memory", "80GiB"]
    preset = _plan(capsys, "--config", "llama3_8b", *layout)
    assert _body(_plan(capsys, *_dims_of("llama3_8b"), *layout)) == _body(preset)
    a = LLAMA3["llama3_8b"]
    config = {"model_type": "llama", "hidden_size": a.dim, "num_hidden_layers": a.n_layers,
              "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "vocab_size": a.vocab_size,
              "intermediate_size": a.ffn_hidden, "tie_word_embeddings": False, "rope_theta": 500000.0,
              "max_position_embeddings": a.max_seq_len}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = _plan(capsys, "--hf-config", str(tmp_path / "config.json"), *layout)
    assert hf.startswith("config.json: ")
    assert "note: config.json: a llama config simulated as the recipe's Llama" in hf
    assert _body(hf).split("\nnote:")[0] == _body(preset).rstrip("\n")
    # A flag overrides the preset's dimension, and the name says so.
    assert _plan(capsys, "--config", "llama3_8b", "--n-layers", "16", *layout).startswith(
        "llama3_8b (n_layers=16): layout: world 8 = dp_replicate 1 x dp_shard 8 x tp 1; 16 blocks")


def test_model_errors(capsys, tmp_path):
    (tmp_path / "moe.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10,
                                                   "num_attention_heads": 4, "intermediate_size": 128,
                                                   "num_local_experts": 8}))
    for argv, error in [(["--world", "2"], "no model: give --config, --hf-config or the dimensions (missing --dim, "
                                           "--n-layers, --n-heads, --vocab-size)"),
                        (["--world", "2", "--hf-config", str(tmp_path / "moe.json")], "a mixture-of-experts model"),
                        (["--world", "2", "--hf-config", str(tmp_path / "none.json")], "none.json: cannot read it")]:
        with pytest.raises(SystemExit):
            main(argv)
        assert error in capsys.readouterr().err


def test_tied_embeddings_in_bf16_are_planned():
    # A tie broken by the planner's own cast to bf16 used to crash its schedule (KeyError).
    args = ModelArgs(dim=64, n_layers=4, n_heads=4, vocab_size=256, tie_embeddings=True, max_seq_len=32)
    tied = estimate_memory(Layout(world=2, batch=1, seq=32, param_dtype=torch.bfloat16), ModelBuilder.llama(args))
    untied = estimate_memory(Layout(world=2, batch=1, seq=32, param_dtype=torch.bfloat16),
                             ModelBuilder.llama(ModelArgs(**{**vars(args), "tie_embeddings": False})))
    assert tied.peak_by_category["sharded_params"] < untied.peak_by_category["sharded_params"]


# ---- suggestions ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_layout_that_does_not_fit_gets_the_nearest_that_do_and_they_fit(capsys):
    base = [*SMALL, "--world", "2", "--no-reserve"]
    peak = _needed(_plan(capsys, *base))
    with_ac = _needed(_plan(capsys, *base, "--activation-checkpointing", "full"))
    assert with_ac < peak
    gpu = f"{(with_ac + peak) // 2}B"  # checkpointing fits, the layout as given does not
    out = _plan(capsys, *base, "--gpu-memory", gpu)
    assert "does NOT fit in" in out
    lines = out.split("nearest layouts that fit (each from this one):\n")[1].splitlines()
    assert lines[0].startswith("  --activation-checkpointing full: needs ")
    assert any(line.startswith("  --batch ") for line in lines), lines
    for line in lines:  # each suggestion, applied, fits
        flags = line.strip().split(":")[0].split()
        assert "fits in" in _plan(capsys, *base, "--gpu-memory", gpu, *flags), line
    # Nothing near fits: said so.
    assert "no layout one or two changes away fits" in _plan(capsys, *base, "--gpu-memory", "1MiB")


def test_readme_shows_the_planner_as_it_prints(capsys):
    # README's first screen quotes a planner command and lines of its output ("..." for the rest).
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"```text\n\s*\$ python -m fsdp2\.plan (.*?)\n(.*?)```", readme, re.S)
    assert block, "README quotes python -m fsdp2.plan"
    out = _plan(capsys, *block[1].split())
    for line in block[2].splitlines():
        line = line.strip()
        if line and line != "...":
            assert line in out, line
