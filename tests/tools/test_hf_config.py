"""One reader of a Hugging Face ``config.json`` (``fsdp2/models/hf_config.py``): the planner's
``--hf-config`` and the recipe's ``checkpoint.initial_load_path`` read the same file into the
same model, rotary scaling, tied embeddings and the exact SwiGLU width included, and refuse a
file the model cannot express in the same words, each naming its own flag.

In this process: the planner's command line up to its model (no simulation), the recipe's
configuration (no process group, no weights read).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fsdp2.checkpoint import model_args_from_hf
from fsdp2.models.llama import ModelArgs
from fsdp2.plan import _cli, main
from recipes.config import ConfigError, parse_args

# Llama 3.1's rotary scaling, tied embeddings, grouped-query attention, and a SwiGLU width (72)
# that 8/3 x hidden_size rounded to a multiple of 32 (the recipe's default: 192) is not.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 72, "vocab_size": 320,
          "max_position_embeddings": 96, "rms_norm_eps": 1e-5, "rope_theta": 5000.0, "tie_word_embeddings": True,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 16}}
# What the model's fields must be, read off CONFIG by hand.
EXPECTED = {"dim": 64, "n_layers": 3, "n_heads": 4, "kv_heads": 2, "ffn_hidden": 72, "vocab_size": 320,
            "norm_eps": 1e-5, "rope_theta": 5000.0, "rope_scaling_factor": 8.0, "rope_low_freq_factor": 1.0,
            "rope_high_freq_factor": 4.0, "rope_original_max_seq_len": 16, "tie_embeddings": True, "moe_experts": 0}


def _folder(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _planner_model(path: Path, *flags: str) -> ModelArgs:
    args = _cli._parse(_cli._parser(), ["--hf-config", str(path), "--world", "2", "--seq", "32", *flags])
    return _cli._model_args(args)[1]


def _shape(model: ModelArgs) -> dict:
    return {name: getattr(model, name) for name in EXPECTED}


def test_the_planner_and_the_recipe_read_the_same_model(tmp_path):
    folder = _folder(tmp_path, CONFIG)
    planner = _planner_model(folder / "config.json")
    recipe = parse_args([f"--checkpoint.initial_load_path={folder}"]).model
    assert _shape(planner) == EXPECTED
    assert _shape(recipe) == EXPECTED
    assert _shape(model_args_from_hf(folder)) == EXPECTED
    # The planner takes the model's folder too; its rotary table covers max_position_embeddings
    # (the recipe's stays the run's own model.max_seq_len).
    assert _planner_model(folder) == planner and planner.max_seq_len == 96
    # A dimension flag overrides the file's, the SwiGLU width too.
    assert _planner_model(folder, "--ffn-hidden", "96").ffn_hidden == 96


BAD = {  # a change to CONFIG -> the words both must say
    "moe": ({"model_type": "mixtral", "num_local_experts": 8}, "num_local_experts 8: a mixture-of-experts model"),
    "moe_as_llama": ({"n_routed_experts": 64}, "n_routed_experts 64: a mixture-of-experts model"),
    "mistral": ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling of type 'yarn' is not supported"),
    "head_dim": ({"head_dim": 32}, "head_dim 32 x num_attention_heads 4 != hidden_size 64"),
    "no_width": ({"intermediate_size": None}, "intermediate_size is missing or not an int"),
    "kv_heads": ({"num_key_value_heads": 3}, "model.n_kv_heads (3) must be a positive divisor of model.n_heads (4)"),
    "bias": ({"attention_bias": True}, "attention_bias=true is not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_config_gets_the_same_refusal_from_both(tmp_path, capsys, case):
    change, words = BAD[case]
    folder = _folder(tmp_path, {**CONFIG, **change})
    with pytest.raises(SystemExit):
        main(["--hf-config", str(folder), "--world", "2"])
    said = re.search(r"error: (.*)", capsys.readouterr().err).group(1)
    with pytest.raises(ConfigError) as recipe:
        parse_args([f"--checkpoint.initial_load_path={folder}"])
    planner_prefix, recipe_prefix = f"--hf-config {folder}: ", f"checkpoint.initial_load_path={folder}: "
    assert said.startswith(planner_prefix) and str(recipe.value).startswith(recipe_prefix), (said, recipe.value)
    problem = said.removeprefix(planner_prefix)
    assert words in problem
    assert str(recipe.value).removeprefix(recipe_prefix) == problem


def test_a_folder_without_config_json_or_a_missing_file_is_named(tmp_path, capsys):
    for path, words in [(tmp_path, "the folder has no config.json"), (tmp_path / "none.json", "cannot read it")]:
        with pytest.raises(SystemExit):
            main(["--hf-config", str(path), "--world", "2"])
        assert f"error: --hf-config {path}: {words}" in capsys.readouterr().err
