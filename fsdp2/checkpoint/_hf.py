"""Hugging Face Llama checkpoints in and out of fsdp2's Llama (``fsdp2/models/llama.py``).

A Hugging Face model folder is ``config.json`` plus ``model.safetensors`` or shards named by
``model.safetensors.index.json``. Only ``json`` and ``safetensors`` are needed here, never
``transformers``.

- Names: ``model.embed_tokens`` is ``tok_embeddings``, ``model.layers.N.self_attn.q_proj`` is
  ``layers.N.attention.wq``, ``mlp.gate_proj/down_proj/up_proj`` are ``feed_forward.w1/w2/w3``,
  ``input_layernorm``/``post_attention_layernorm`` are ``attention_norm``/``ffn_norm``,
  ``model.norm`` is ``norm`` and ``lm_head`` is ``output`` (absent when the embeddings are tied).
- Rotary layout: fsdp2's model rotates channel pairs ``(2i, 2i+1)`` of each head (Meta's
  interleaved layout); Hugging Face's rotates ``(i, i + head_dim/2)`` (``rotate_half``). The
  same rotation, with the rows of ``q_proj`` and ``k_proj`` permuted inside each head: row
  ``2i + j`` here is row ``j * head_dim/2 + i`` there.
- ``config.json`` <-> ``ModelArgs`` is ``fsdp2/models/hf_config.py`` (the one reader, shared with
  the recipe and the planner's ``--hf-config``); :func:`model_args_from_hf`, :func:`hf_config`
  and :func:`is_hf_folder` are re-exported from it.
- In: :func:`model_args_from_hf` reads ``config.json`` (refusing, in one line naming the
  field, what the model cannot express), :func:`check_hf_weights` checks the tensors' names
  and shapes from the safetensors headers alone, and :func:`load_hf` fills a sharded model:
  each rank memory-maps the files and reads only its own rows (:func:`load_full`), the
  permuted q/k rows included.
- Out: :func:`export_hf` gathers one parameter at a time (a collective) and rank 0 streams it,
  renamed, permuted and cast, into safetensors shards of at most ``max_shard_bytes`` with
  their index, then writes ``config.json``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import BinaryIO, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..models.hf_config import CONFIG, DTYPE_NAMES, hf_config, is_hf_folder, model_args_from_hf
from ..models.llama import ModelArgs
from ._full import INDEX, _Gatherer, _header, _resolve_files, load_full
from ._safetensors import StreamingWriter, import_safetensors

__all__ = ["model_args_from_hf", "hf_config", "hf_names", "check_hf_weights", "load_hf", "export_hf",
           "HFWriter", "is_hf_folder", "hf_row_order"]

logger = logging.getLogger(__name__)
DEFAULT_SHARD_BYTES = 5 * 2**30  # Hugging Face's save_pretrained default (5 GB)


# ---- names and the rotary permutation -------------------------------------------------------
_BLOCK = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
          "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
          "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
          "post_attention_layernorm": "ffn_norm"}


def hf_names(args: ModelArgs) -> dict[str, str]:
    """Hugging Face name -> fsdp2 name of every tensor a model of shape ``args`` stores, in file order."""
    names = {"model.embed_tokens.weight": "tok_embeddings.weight"}
    for layer in range(args.n_layers):
        for theirs, ours in _BLOCK.items():
            names[f"model.layers.{layer}.{theirs}.weight"] = f"layers.{layer}.{ours}.weight"
    names["model.norm.weight"] = "norm.weight"
    if not args.tie_embeddings:
        names["lm_head.weight"] = "output.weight"
    return names


def _expected_shapes(args: ModelArgs) -> dict[str, list[int]]:
    """fsdp2 name -> shape, for the tensors :func:`hf_names` lists."""
    hd, d, f = args.head_dim, args.dim, args.ffn_hidden
    block = {"attention.wq": [args.n_heads * hd, d], "attention.wk": [args.kv_heads * hd, d],
             "attention.wv": [args.kv_heads * hd, d], "attention.wo": [d, args.n_heads * hd],
             "feed_forward.w1": [f, d], "feed_forward.w2": [d, f], "feed_forward.w3": [f, d],
             "attention_norm": [d], "ffn_norm": [d]}
    shapes = {"tok_embeddings.weight": [args.vocab_size, d], "norm.weight": [d], "output.weight": [args.vocab_size, d]}
    for layer in range(args.n_layers):
        shapes.update({f"layers.{layer}.{k}.weight": v for k, v in block.items()})
    return shapes


def hf_row_order(heads: int, head_dim: int) -> torch.Tensor:
    """Row ``r`` of fsdp2's q/k projection is row ``order[r]`` of Hugging Face's (int64, heads * head_dim)."""
    half = head_dim // 2
    pair = torch.arange(half).repeat_interleave(2)  # i of rows 2i and 2i+1
    which = torch.arange(2).repeat(half)  # j: 0 for row 2i, 1 for row 2i+1
    within = which * half + pair  # (head_dim,): row 2i + j comes from row j * half + i
    return (torch.arange(heads)[:, None] * head_dim + within).reshape(-1)


def _row_orders(args: ModelArgs) -> dict[str, torch.Tensor]:
    """fsdp2 name -> its row order, for the q and k projections of every layer."""
    q, k = hf_row_order(args.n_heads, args.head_dim), hf_row_order(args.kv_heads, args.head_dim)
    orders = {}
    for layer in range(args.n_layers):
        orders[f"layers.{layer}.attention.wq.weight"] = q
        orders[f"layers.{layer}.attention.wk.weight"] = k
    return orders


# ---- in ------------------------------------------------------------------------------------------
def check_hf_weights(path: str | os.PathLike, args: ModelArgs) -> None:
    """Raise ValueError (one line) unless the folder's safetensors hold every tensor ``args`` needs, in its shape.

    Reads only the headers (the index and each file's first bytes): no tensor data, no model.
    """
    try:
        files = _resolve_files(Path(path))
    except FileNotFoundError as e:
        raise ValueError(str(e).removeprefix("load_full: ")) from None
    shapes: dict[str, list[int]] = {}
    for file in files:
        shapes.update({k: v["shape"] for k, v in _header(Path(file)).items()})
    expected = _expected_shapes(args)
    for theirs, ours in hf_names(args).items():
        if theirs not in shapes:
            raise ValueError(f"{path}: tensor {theirs} is missing from its safetensors (config.json's model needs it)")
        if shapes[theirs] != expected[ours]:
            raise ValueError(f"{path}: tensor {theirs} has shape {shapes[theirs]}, config.json's model needs "
                             f"{expected[ours]}")
    if args.tie_embeddings and "lm_head.weight" in shapes:
        logger.warning("%s: lm_head.weight is ignored: config.json ties it to the embeddings", path)


def load_hf(path: str | os.PathLike, model: nn.Module) -> None:
    """Fill ``model`` (fsdp2's Llama, sharded or not, built from :func:`model_args_from_hf`) from a Hugging Face folder.

    Collective only in that every rank calls it: each memory-maps the safetensors and reads the
    rows it owns, the q/k rows in the permuted order, so no rank holds the whole model and nothing
    is sent. Call :func:`check_hf_weights` first for a one-line error before allocating.
    """
    args: ModelArgs = model.args
    names = hf_names(args)
    load_full(path, model, key_map=lambda key: names.get(key), row_orders=_row_orders(args))


# ---- out -----------------------------------------------------------------------------------------
class HFWriter:
    """Streams named tensors into Hugging Face's safetensors layout in ``folder``, one at a time.

    ``specs`` (name -> (shape, dtype), in writing order) are split into consecutive shards of
    at most ``max_shard_bytes`` (a larger tensor gets a shard of its own). One shard is written
    as ``model.safetensors``; several as ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json``. Each file is written under a temporary name and renamed
    when complete.
    """

    def __init__(self, folder: str | os.PathLike, specs: dict[str, tuple[torch.Size, torch.dtype]],
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        shards: list[dict[str, tuple[torch.Size, torch.dtype]]] = [{}]
        size = 0
        for name, (shape, dtype) in specs.items():
            nbytes = math.prod(shape) * dtype.itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = (shape, dtype)
            size += nbytes
        n = len(shards)
        self.names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                                            for i in range(n)]
        self.total_bytes = sum(math.prod(s) * d.itemsize for s, d in specs.values())
        self._shards = shards
        self._current = -1
        self._file: BinaryIO | None = None
        self._writer: StreamingWriter | None = None
        self._left = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._left == 0:
            self._next_shard()
        self._writer.write(name, tensor)
        self._left -= 1

    def _next_shard(self) -> None:
        self._finish_shard()
        self._current += 1
        if self._current >= len(self._shards):
            raise ValueError("HFWriter: more tensors written than its specs name")
        specs = self._shards[self._current]
        self._file = open(self.folder / f"{self.names[self._current]}.tmp", "wb")
        self._writer = StreamingWriter(self._file, specs, {"format": "pt"})
        self._left = len(specs)

    def _finish_shard(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._file.close()
        name = self.names[self._current]
        os.replace(self.folder / f"{name}.tmp", self.folder / name)
        self._writer = self._file = None

    def close(self) -> None:
        """Finish the last shard and write the index (several shards); raises if tensors are missing."""
        self._finish_shard()
        if self._current != len(self._shards) - 1:
            raise RuntimeError(f"HFWriter closed after {self._current + 1} of {len(self._shards)} shards")
        stale = self.folder / INDEX
        if len(self._shards) > 1:
            weight_map = {name: self.names[i] for i, shard in enumerate(self._shards) for name in shard}
            stale.write_text(json.dumps({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map},
                                        indent=2))
        elif stale.exists():
            stale.unlink()  # an earlier export's index would name shards this one does not have

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            (self.folder / f"{self.names[self._current]}.tmp").unlink(missing_ok=True)


def to_hf(name: str, tensor: torch.Tensor, args: ModelArgs, dtype: torch.dtype) -> torch.Tensor:
    """fsdp2 tensor ``name`` as Hugging Face stores it: q/k rows in ``rotate_half`` order, cast to ``dtype``."""
    heads = {"attention.wq.weight": args.n_heads, "attention.wk.weight": args.kv_heads}.get(name.split(".", 2)[-1])
    if heads is not None:
        order = hf_row_order(heads, args.head_dim)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        tensor = tensor[inverse.to(tensor.device)]  # (rows in Hugging Face's order, dim)
    return tensor.to(dtype)


def write_hf(folder: str | os.PathLike, args: ModelArgs, read: Callable[[str], torch.Tensor], *,
             dtype: torch.dtype = torch.float32, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write a model of shape ``args`` and its ``config.json`` to ``folder``; returns the files written.

    ``read(name)`` returns the full tensor of fsdp2 name ``name``; it is called once per tensor,
    in :func:`hf_names` order, and its result is written before the next call. One process:
    no collective.
    """
    import_safetensors()
    if Path(folder).is_dir():
        _remove_stale(Path(folder))
    shapes = _expected_shapes(args)
    names = hf_names(args)
    writer = HFWriter(folder, {theirs: (torch.Size(shapes[ours]), dtype) for theirs, ours in names.items()},
                      max_shard_bytes)
    try:
        for theirs, ours in names.items():
            writer.write(theirs, to_hf(ours, read(ours), args, dtype))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    (Path(folder) / CONFIG).write_text(json.dumps(hf_config(args, dtype), indent=2))
    return [CONFIG, *writer.names] + ([INDEX] if len(writer.names) > 1 else [])


def export_hf(folder: str | os.PathLike, model: nn.Module, *, dtype: torch.dtype = torch.float32,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write fsdp2's Llama ``model`` (sharded or not) as a Hugging Face ``LlamaForCausalLM`` folder.

    Call on every rank: each parameter is gathered in turn (a collective) and rank 0 renames,
    permutes, casts and streams it into the shards, so rank 0 holds about one full parameter
    beyond its shards. ``LlamaForCausalLM.from_pretrained(folder)`` loads the result.

    Args:
        folder: the output directory (created; files it holds of the same names are replaced).
        model: an fsdp2 ``Transformer`` (``model.args`` is its shape).
        dtype: the stored dtype (float32, bfloat16 or float16).
        max_shard_bytes: the largest shard; more bytes than this are split over several files
            and an index.
    """
    if dtype not in DTYPE_NAMES.values():
        raise ValueError(f"export_hf: dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype}")
    args: ModelArgs = model.args
    state = model.state_dict()
    order = [name for name in hf_names(args).values()]
    missing = [name for name in order if name not in state]
    if missing:
        raise ValueError(f"export_hf: the model has no {missing[0]}: is it fsdp2's Llama Transformer?")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    gather = _Gatherer()
    if rank0:
        write_hf(folder, args, lambda name: gather(state[name]), dtype=dtype, max_shard_bytes=max_shard_bytes)
    else:
        for name in order:  # join every gather, in the writer's order
            gather(state[name])
    if dist.is_initialized():
        dist.barrier()


def _remove_stale(folder: Path) -> None:
    """Delete ``folder``'s safetensors and index (an earlier export's): ``from_pretrained`` would
    prefer a stale ``model.safetensors`` to a new index."""
    for file in [*folder.glob("model*.safetensors"), folder / INDEX]:
        file.unlink(missing_ok=True)
