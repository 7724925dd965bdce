"""The model's shape from a Hugging Face folder's ``config.json``, while the configuration is built.

Below ``recipes/config.py`` (which calls :func:`hf_model_values` when
``checkpoint.initial_load_path`` is set); the rest of the recipe's Hugging Face support, which
reads a finished ``JobConfig``, is ``recipes/hf.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdp2.checkpoint import _hf
from fsdp2.checkpoint._hf import is_hf_folder

from .errors import ConfigError

__all__ = ["hf_model_values"]

# The ModelArgs field each config.json key decides (for error messages).
_HF_KEY = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size", "ffn_hidden_size": "intermediate_size",
           "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "tie_embeddings": "tie_word_embeddings",
           "moe_experts": "model_type", "rope_scaling_factor": "rope_scaling.factor",
           "rope_low_freq_factor": "rope_scaling.low_freq_factor",
           "rope_high_freq_factor": "rope_scaling.high_freq_factor",
           "rope_original_max_seq_len": "rope_scaling.original_max_position_embeddings"}


def hf_model_values(path: str, model: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The ``[model]`` values with what a Hugging Face folder's ``config.json`` decides put in.

    ``model``: the values from the config file and the command line; ``given``: those the
    command line set, which must agree with config.json (a TOML's model shape is replaced:
    the checked-in configs describe the recipe's own byte-level model). ``path`` that is not a
    Hugging Face folder (no ``config.json``) changes nothing.
    """
    if not is_hf_folder(path):
        return model
    try:
        fields = _hf.hf_fields(path)
    except ValueError as e:
        raise ConfigError(f"checkpoint.initial_load_path={path}: {e}") from None
    for name, value in fields.items():
        if name in given and given[name] != value:
            raise ConfigError(f"--model.{name}={given[name]} contradicts {Path(path) / 'config.json'}'s "
                              f"{_HF_KEY[name]} ({value}): a Hugging Face model's shape comes from its config.json; "
                              f"drop --model.{name}")
    return {**model, **fields}
