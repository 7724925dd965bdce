"""The model's shape from a Hugging Face folder's ``config.json``, while the configuration is built.

Below ``recipes/config.py`` (which calls :func:`hf_model_values` when
``checkpoint.initial_load_path`` is set); the rest of the recipe's Hugging Face support, which
reads a finished ``JobConfig``, is ``recipes/hf.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdp2.models.hf_config import CONFIG, HF_KEYS, is_hf_folder, read_hf_config

from .errors import ConfigError

__all__ = ["hf_model_values"]


def hf_model_values(path: str, model: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The ``[model]`` values with what a Hugging Face folder's ``config.json`` decides put in.

    ``model``: the values from the config file and the command line; ``given``: those the
    command line set, which must agree with config.json (a TOML's model shape is replaced:
    the checked-in configs describe the recipe's own byte-level model). ``path`` that is not a
    Hugging Face folder (no ``config.json``) changes nothing. config.json is read by
    ``fsdp2.models.hf_config.read_hf_config``, as the planner's ``--hf-config`` reads it.
    """
    if not is_hf_folder(path):
        return model
    try:
        fields = read_hf_config(path, where=f"checkpoint.initial_load_path={path}").fields
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for name, value in fields.items():
        if name in given and given[name] != value:
            raise ConfigError(f"--model.{name}={given[name]} contradicts {Path(path) / CONFIG}'s "
                              f"{HF_KEYS[name]} ({value}): a Hugging Face model's shape comes from its config.json; "
                              f"drop --model.{name}")
    return {**model, **fields}
