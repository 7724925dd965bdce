"""The recipe's checked-in configs and its ``--help``.

- ``recipes/configs/llama3_8b.toml`` is Llama 3 8B (Meta's shapes, as the planner's preset), and
  the memory planner, run as the config's header says, finds that it fits 8 GPUs of 80 GB;
  the planner's layout is the config's own (batch, sequence, precision, checkpointing, world).
  It is not run here: on CPU it would need 96 GB per rank.
- ``--help`` prints every key with the value the command line would use, its type and a
  description (each field's comment in recipes/config.py).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp2.plan import Layout, ModelBuilder, estimate_memory
from fsdp2.models.llama import LLAMA3
from recipes.config import SECTIONS, field_help, parse_args
from recipes.llama.parallelize import ParallelDims
from recipes.train import main as train_main

REPO = Path(__file__).resolve().parents[2]
GETTING_STARTED = REPO / "docs" / "getting-started.md"
CONFIG_8B = REPO / "recipes" / "configs" / "llama3_8b.toml"
GPUS, GPU_MEMORY = 8, 80 * 2**30


def _plan_command() -> list[str]:
    """The planner command quoted in the config's header comment, as arguments."""
    text = CONFIG_8B.read_text()
    match = re.search(r"^#\s+(python -m fsdp2\.plan .*?)\\\n#\s+(.*?)$", text, re.M)
    assert match, "llama3_8b.toml's header quotes the planner command"
    return shlex.split(match[1] + " " + match[2])[1:]  # without "python"


def test_llama3_8b_config_is_llama3_8b():
    config = parse_args(["--config", str(CONFIG_8B)])
    assert config.model == LLAMA3["llama3_8b"]
    with torch.device("meta"):
        from recipes.llama.model import Transformer

        n_params = sum(p.numel() for p in Transformer(config.model).parameters())
    assert n_params == 8_030_261_248  # "8.03B" in the header
    t = config.training
    assert (t.batch_size, t.seq_len, t.grad_accum, t.mixed_precision, t.activation_checkpoint) == \
        (1, 8192, 1, "bf16", True)
    dims = ParallelDims(config.parallelism.dp_replicate, config.parallelism.dp_shard, config.parallelism.tp, GPUS)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (1, 8, 1)
    assert "tokens/step = batch_size x seq_len x grad_accum x data-parallel ranks\n" \
           "#             = 1 x 8,192 x 1 x 8 = 65,536 tokens" in CONFIG_8B.read_text()


@pytest.mark.slow  # among the quick suite's longest (CI runs it on torch 2.13)
def test_llama3_8b_config_fits_8_gpus_of_80gb_by_the_planner():
    config = parse_args(["--config", str(CONFIG_8B)])
    t = config.training
    # The config's layout, in the planner's terms.
    layout = Layout(world=GPUS, batch=t.batch_size, seq=t.seq_len, grad_accum=t.grad_accum,
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                    activation_checkpointing=t.activation_checkpoint)
    estimate = estimate_memory(layout, ModelBuilder.llama(config.model), gpu_memory=GPU_MEMORY)
    assert estimate.fits
    # The command in the header states the same layout and prints the same verdict.
    proc = subprocess.run([sys.executable, *_plan_command()], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    needed = estimate.needed_bytes / 2**30
    assert f"fits in 80.00 GiB: needs {needed:.2f} GiB" in proc.stdout, proc.stdout
    assert f"= {needed:.1f} GiB per GPU" in CONFIG_8B.read_text()
    assert f"needs {needed:.2f} GiB per GPU" in " ".join(GETTING_STARTED.read_text().split())
    assert "batch 1 x seq 8192; param bfloat16" in proc.stdout and "activation_checkpointing=True" in proc.stdout


def test_help_describes_every_key_with_the_command_lines_values(capsys):
    train_main(["--config", str(CONFIG_8B), "--training.lr=1e-4", "--help"])
    out = capsys.readouterr().out
    for section, cls in SECTIONS.items():
        helps = field_help(cls)
        for f in dataclasses.fields(cls):
            assert helps.get(f.name), f"{section}.{f.name} has no description (a comment beside its field)"
            # The key with its value, its type, then the first words of its description.
            first_words = " ".join(helps[f.name].split()[:3])
            assert re.search(rf"^  --{section}\.{f.name}=\S* +\(.+\)\n +{re.escape(first_words)}", out, re.M), \
                f"{section}.{f.name}"
    assert "--model.dim=4096  (an int)" in out  # the config file's value
    assert "--training.lr=0.0001  (a float)" in out  # the override's
    assert "--validation.enable=true" in out


def test_getting_started_shows_help_as_printed(capsys):
    sample = re.search(r"```text\n(\[training\]\n.*?)```", GETTING_STARTED.read_text(), re.S)[1]
    train_main(["--help"])
    assert sample in capsys.readouterr().out


def test_help_with_a_bad_override_is_the_config_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--training.lrr=1", "--help"])
    assert exit_info.value.code == 2
    assert "unknown key 'training.lrr'" in capsys.readouterr().err
