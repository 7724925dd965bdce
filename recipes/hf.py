"""Hugging Face models in the recipe: fine-tune a Llama-family model folder, export one at the end.

- ``--checkpoint.initial_load_path=FOLDER`` where ``FOLDER`` holds ``config.json`` (and
  ``model.safetensors`` or a shard index): the model's shape comes from ``config.json``
  (``recipes.hf_config.hf_model_values``, called while the configuration is built), its weights from the
  safetensors, each rank reading its own rows (``fsdp2.checkpoint.load_hf``). What the model
  cannot express, a missing tensor, or a tokenizer with more tokens than the model's vocabulary
  stops the run in one line before anything is allocated (:func:`check_hf_run`).
- ``--checkpoint.export_hf=DIR`` writes the final model as a Hugging Face folder
  (``config.json`` plus safetensors, in ``checkpoint.export_hf_dtype``), streamed one
  parameter at a time (:func:`export_hf_model`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import torch.nn as nn

from fsdp2.checkpoint import _hf
from fsdp2.checkpoint._hf import DTYPE_NAMES, is_hf_folder

from .data import tokenizer_vocab_size as data_vocab_size

if TYPE_CHECKING:
    from .config import JobConfig

__all__ = ["check_hf_run", "tokenizer_vocab_size", "check_tokenizer_vocab", "export_hf_model"]

def tokenizer_vocab_size(config: JobConfig) -> int:
    """How many token ids the run's tokenizer produces (``--tokenizer``'s; bytes: 256)."""
    return data_vocab_size(config.data.tokenizer, eos_token=config.data.eos_token)


def check_tokenizer_vocab(tokenizer_vocab: int, model_vocab: int, source: str) -> None:
    """Raise ValueError when the tokenizer can produce ids the model's embedding has no row for.

    A smaller tokenizer is fine (the model's extra rows are never looked up); a larger one
    would index past the embedding table on the first batch that uses such a token.
    """
    if tokenizer_vocab > model_vocab:
        raise ValueError(f"the tokenizer has {tokenizer_vocab} tokens but {source} has vocab_size {model_vocab}: "
                         "token ids past the model's vocabulary have no embedding; use the model's own tokenizer "
                         "or a model with a larger vocabulary")


def check_hf_run(config: JobConfig) -> None:
    """Raise ValueError, before anything is allocated, for a Hugging Face load or export that would fail."""
    path = config.checkpoint.initial_load_path
    if path and is_hf_folder(path):
        if importlib.util.find_spec("safetensors") is None:
            raise ValueError(f"checkpoint.initial_load_path={path}: reading a Hugging Face model needs the "
                             "'safetensors' package (pip install -e '.[checkpoint]')")
        try:
            _hf.check_hf_weights(path, config.model)
        except ValueError as e:
            raise ValueError(f"checkpoint.initial_load_path={e}") from None
        check_tokenizer_vocab(tokenizer_vocab_size(config), config.model.vocab_size, f"{Path(path) / 'config.json'}")
    if out := config.checkpoint.export_hf:
        if Path(out).is_file():
            raise ValueError(f"checkpoint.export_hf={out} is a file; give a directory (it gets config.json and "
                             "the safetensors)")
        if importlib.util.find_spec("safetensors") is None:
            raise ValueError(f"checkpoint.export_hf={out}: writing safetensors needs the 'safetensors' package "
                             "(pip install -e '.[checkpoint]')")
        if config.model.moe_experts:
            raise ValueError(f"checkpoint.export_hf={out}: a mixture-of-experts model has no LlamaForCausalLM "
                             "equivalent; use checkpoint.export")


def export_hf_model(model: nn.Module, config: JobConfig) -> None:
    """Collective: the final model as a Hugging Face folder at ``checkpoint.export_hf``."""
    c = config.checkpoint
    _hf.export_hf(c.export_hf, model, dtype=DTYPE_NAMES[c.export_hf_dtype])
