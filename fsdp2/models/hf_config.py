"""A Hugging Face Llama ``config.json`` and the recipe Llama's :class:`ModelArgs`: one reader, one writer.

Everything in fsdp2 that takes a Hugging Face ``config.json`` reads it with
:func:`read_hf_config`: the recipe (``checkpoint.initial_load_path``), the memory planner
(``python -m fsdp2.plan --hf-config``) and the checkpoint helpers
(``fsdp2.checkpoint.model_args_from_hf``, ``python -m fsdp2.checkpoint export-hf --hf-config``).
So they accept the same files, read them into the same fields, and refuse the same ones in the
same words; each caller names its own flag or key (``where``) in front of the problem.
:func:`hf_config` writes the ``config.json`` of a model (``fsdp2.checkpoint.export_hf``).

Only what the model can express is read: a dense ``LlamaForCausalLM`` (silu SwiGLU, no biases,
heads that split ``hidden_size``) with no rotary scaling or Llama 3.1's (``rope_type``
"llama3"). Anything else is refused in one line naming the field: reading another
architecture's sizes into this model would give a model, or a memory plan, that is not that one.
Only ``json`` is needed, never ``transformers``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .llama import ModelArgs

__all__ = ["CONFIG", "DTYPE_NAMES", "HF_KEYS", "MOE_KEYS", "HFShape", "read_hf_config", "model_args_from_hf",
           "hf_config", "is_hf_folder"]

CONFIG = "config.json"
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The config.json key that decides each ModelArgs field (the sizes are read through it; for messages).
HF_KEYS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size", "ffn_hidden_size": "intermediate_size",
           "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "tie_embeddings": "tie_word_embeddings",
           "moe_experts": "model_type", "rope_scaling_factor": "rope_scaling.factor",
           "rope_low_freq_factor": "rope_scaling.low_freq_factor",
           "rope_high_freq_factor": "rope_scaling.high_freq_factor",
           "rope_original_max_seq_len": "rope_scaling.original_max_position_embeddings"}
_SIZES = ("dim", "n_layers", "n_heads", "ffn_hidden_size", "vocab_size")  # required ints, in the order checked
# Keys by which Hugging Face's mixture-of-experts configs (Mixtral, Qwen-MoE, DeepSeek) count their experts.
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_LLAMA3_KEYS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor",
                "original_max_position_embeddings": "rope_original_max_seq_len"}


class HFShape(NamedTuple):
    """What :func:`read_hf_config` read from one ``config.json``."""

    fields: dict[str, Any]  # the ModelArgs fields config.json decides (HF_KEYS's)
    max_position_embeddings: int | None  # the context it was trained for (the default max_seq_len), if given
    file: Path  # the config.json read


def is_hf_folder(path: str | os.PathLike) -> bool:
    """A directory holding ``config.json`` (a Hugging Face model folder)."""
    return Path(path).is_dir() and (Path(path) / CONFIG).is_file()


def read_hf_config(path: str | os.PathLike, *, where: str | None = None) -> HFShape:
    """The :class:`ModelArgs` fields a Hugging Face Llama ``config.json`` decides.

    Args:
        path: the ``config.json`` file, or a model folder holding one.
        where: what each error message starts with: the caller's flag and the path as the user
            gave it (``"--hf-config PATH"``, ``"checkpoint.initial_load_path=PATH"``); by
            default the file's path.

    Raises:
        ValueError: in one line, ``"{where}: {problem}"``: a file that cannot be read or is not
            JSON, a mixture-of-experts model, another architecture, rotary scaling other than
            Llama 3.1's, biases, an activation other than silu, a size missing or not an int, a
            ``head_dim`` that does not split ``hidden_size``, or sizes the model refuses.
    """
    path = Path(path)
    file = path / CONFIG if path.is_dir() else path
    where = str(file) if where is None else where
    if path.is_dir() and not file.is_file():
        raise ValueError(f"{where}: the folder has no {CONFIG}")
    try:
        config = json.loads(file.read_text())
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: not a config.json (a JSON object of the model's settings)")
    _refuse_unsupported(config, where)
    kv = config.get("num_key_value_heads")
    fields = {field: config[HF_KEYS[field]] for field in _SIZES}
    fields.update(n_kv_heads=kv, norm_eps=float(config.get("rms_norm_eps", 1e-6)), **_rope(config, where),
                  tie_embeddings=bool(config.get("tie_word_embeddings", False)), moe_experts=0)
    try:
        ModelArgs(**fields)  # what the model itself checks (grouped-query heads, rotary pairs), said here
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    positions = config.get("max_position_embeddings")
    return HFShape(fields, positions if isinstance(positions, int) and positions > 0 else None, file)


def model_args_from_hf(path: str | os.PathLike, **fields: Any) -> ModelArgs:
    """The :class:`ModelArgs` of a Hugging Face Llama ``config.json`` (a file, or a model folder).

    ``fields`` set what config.json does not decide (``max_seq_len``: by default its
    ``max_position_embeddings``; ``init_std``); they cannot override what it does (:data:`HF_KEYS`).

    Raises:
        ValueError: in one line naming the field, for what the model cannot express
            (:func:`read_hf_config`), or a field given that config.json decides.
    """
    shape = read_hf_config(path)
    clash = sorted(set(fields) & set(shape.fields))
    if clash:
        raise ValueError(f"model_args_from_hf: {clash[0]} comes from config.json; do not pass it")
    if "max_seq_len" not in fields and shape.max_position_embeddings is not None:
        fields["max_seq_len"] = shape.max_position_embeddings
    return ModelArgs(**shape.fields, **fields)


def _refuse_unsupported(config: dict[str, Any], where: str) -> None:
    """One line naming the first field the model cannot express."""
    experts = next(((k, config[k]) for k in MOE_KEYS if config.get(k)), None)
    if experts is not None:  # (before model_type: "mixtral" alone would not say why)
        raise ValueError(f"{where}: {experts[0]} {experts[1]!r}: a mixture-of-experts model is not supported: "
                         "only dense Llama blocks (LlamaForCausalLM) are read into the recipe's Llama")
    model_type = config.get("model_type")
    if model_type != "llama":
        raise ValueError(f"{where}: model_type {model_type!r} is not supported: only Llama-family models "
                         "(model_type 'llama', LlamaForCausalLM) are read into the recipe's Llama")
    archs = config.get("architectures")
    if archs is not None and archs != ["LlamaForCausalLM"]:
        raise ValueError(f"{where}: architectures {archs!r} is not supported: only ['LlamaForCausalLM']")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {config['hidden_act']!r} is not supported: the model's SwiGLU uses silu")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ValueError(f"{where}: {flag}=true is not supported: the model's projections have no biases")
    missing = [HF_KEYS[f] for f in _SIZES if not isinstance(config.get(HF_KEYS[f]), int)
               or isinstance(config.get(HF_KEYS[f]), bool)]
    if missing:
        raise ValueError(f"{where}: {missing[0]} is missing or not an int")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * config["num_attention_heads"] != config["hidden_size"]:
        raise ValueError(f"{where}: head_dim {head_dim} x num_attention_heads {config['num_attention_heads']} != "
                         f"hidden_size {config['hidden_size']}: the model's heads split hidden_size exactly")


def _rope(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The rotary fields: ``rope_theta``, and Llama 3.1's scaling (``rope_type`` "llama3"); any other
    scaling is refused. Reads transformers 5's ``rope_parameters`` or the older ``rope_scaling``."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict):
        params.update(scaling)
    elif scaling:
        raise ValueError(f"{where}: rope_scaling {scaling!r} is not supported: give null or a llama3 scaling")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ValueError(f"{where}: rope_scaling of type {kind!r} is not supported (the model implements no "
                         "scaling and Llama 3.1's 'llama3'); use a model whose rope_scaling is null or llama3")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ValueError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    if kind == "default":
        return {"rope_theta": float(theta), "rope_scaling_factor": 1.0}
    missing = [k for k in _LLAMA3_KEYS if not isinstance(params.get(k), (int, float))]
    if missing:
        raise ValueError(f"{where}: the llama3 rope scaling has no {missing[0]}")
    fields = {ours: float(params[theirs]) for theirs, ours in _LLAMA3_KEYS.items()}
    fields["rope_original_max_seq_len"] = int(params["original_max_position_embeddings"])
    return {"rope_theta": float(theta), **fields}


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A Hugging Face ``LlamaForCausalLM`` ``config.json`` for a model of shape ``args`` (what
    :func:`read_hf_config` reads back into the same fields)."""
    if args.moe_experts:
        raise ValueError("hf_config: a mixture-of-experts model has no LlamaForCausalLM equivalent")
    dtype_name = next(name for name, d in DTYPE_NAMES.items() if d == dtype)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling_factor > 1.0:
        rope = {"rope_type": "llama3", "rope_theta": args.rope_theta,
                **{theirs: getattr(args, ours) for theirs, ours in _LLAMA3_KEYS.items()}}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "intermediate_size": args.ffn_hidden,
            "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len, "hidden_act": "silu",
            "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
            "rope_parameters": rope,
            "tie_word_embeddings": args.tie_embeddings, "attention_bias": False, "mlp_bias": False,
            "initializer_range": args.init_std, "torch_dtype": dtype_name, "dtype": dtype_name,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
