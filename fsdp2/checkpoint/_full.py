"""Full (unsharded) single-file models: export for inference, import pretrained weights.

``export_full`` gathers one parameter at a time (``full_tensor()``, a
collective every rank joins) and rank 0 streams it to the file, so the writer
holds about one full parameter beyond its shards. ``load_full`` has each rank
memory-map the file and read only the rows it owns: no broadcast, and no rank
ever holds a full copy of the model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import _compat
from .._format import chunk_rows
from ..runtime._param import ShardedParam
from ..runtime._state import get_state
from ._meta import materialize
from ._safetensors import StreamingWriter, import_safetensors

__all__ = ["export_full", "load_full"]

INDEX = "model.safetensors.index.json"
KeyMap = Callable[[str], "str | None"] | Mapping[str, str]


def export_full(path: str | os.PathLike, model: nn.Module, *, format: str = "safetensors") -> None:
    """Write ``model``'s full state dict to one file, gathering one parameter at a time.

    Call on every rank (each gather is a collective); rank 0 writes. Keys are
    the unsharded model's, tied parameters appear under each of their names.

    Args:
        path: the output file.
        model: a sharded (or plain) model.
        format: ``"safetensors"`` (streamed: peak extra memory on rank 0 is
            about one full parameter) or ``"torch"`` (``torch.save`` of a dict
            of CPU tensors; ``torch.save`` needs the whole dict, so rank 0 holds
            the full model at the end).
    """
    if format not in ("safetensors", "torch"):
        raise ValueError(f"export_full: format must be 'safetensors' or 'torch', got {format!r}")
    state = model.state_dict()  # shards and buffers, no communication
    writer_rank = not dist.is_initialized() or dist.get_rank() == 0
    specs = {key: (value.shape, value.dtype) for key, value in state.items()}
    tmp = Path(f"{path}.tmp")
    if format == "torch":
        gather = _Gatherer()
        full = {key: _cpu_copy(gather(value)) for key, value in state.items()} if writer_rank else \
            {key: gather(value) for key, value in state.items()}
        if writer_rank:
            torch.save(full, tmp)
    else:
        import_safetensors()  # fail before any collective if the reader side is missing
        file = open(tmp, "wb") if writer_rank else None
        try:
            writer = StreamingWriter(file, specs, {"format": "pt"}) if writer_rank else None
            gather = _Gatherer()
            for key, value in state.items():
                tensor = gather(value)
                if writer is not None:
                    writer.write(key, tensor)
            if writer is not None:
                writer.close()
        finally:
            if file is not None:
                file.close()
    if writer_rank:
        os.replace(tmp, path)  # readers never see a half-written file
    if dist.is_initialized():
        dist.barrier()


class _Gatherer:
    """All-gathers one sharded tensor at a time into one reused buffer.

    ``DTensor.full_tensor()`` allocates a fresh result per parameter, and the
    freed results are not reliably given back to the OS: exporting a 200 MB
    model that way grew every rank's peak RSS by most of the model. Reusing
    one buffer (grown to the largest parameter) bounds it by one parameter.
    The returned tensor is valid until the next call.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        if not isinstance(value, DTensor):
            return value.detach()
        mesh = value.device_mesh
        cut = [axis for axis, placement in enumerate(value.placements) if not isinstance(placement, Replicate)]
        # One Shard axis (FSDP, or HSDP whose replicate axis holds copies): gather over that axis only.
        # Anything else (FSDP x TP's strided shards) takes DTensor's general path.
        if len(cut) != 1 or type(value.placements[cut[0]]) is not Shard:
            return value.full_tensor()
        axis, placement = cut[0], value.placements[cut[0]]
        world, dim, n = mesh.size(axis), placement.dim, value.shape[placement.dim]
        chunk = chunk_rows(n, world)
        local = value.to_local()
        padded_shape = list(value.shape)
        padded_shape[dim] = chunk
        send = local.new_zeros(padded_shape)
        send.narrow(dim, 0, local.shape[dim]).copy_(local)
        numel = send.numel() * world
        key = (send.dtype, send.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            self._buffers[key] = buffer = None  # free the old one before allocating the new one
            self._buffers[key] = buffer = torch.empty(numel, dtype=send.dtype, device=send.device)
        out = buffer[:numel]
        _compat.all_gather_flat(out, send.reshape(-1), group=mesh.get_group(axis))
        gathered = out.view(world, *padded_shape).movedim(0, dim).flatten(dim, dim + 1)  # (.., world*chunk, ..)
        return gathered.narrow(dim, 0, n)


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("cpu", copy=True)


def load_full(path: str | os.PathLike, model: nn.Module, key_map: KeyMap | None = None, *,
              row_orders: Mapping[str, torch.Tensor] | None = None) -> None:
    """Load full weights from safetensors into a sharded ``model``; each rank reads only its rows.

    ``path`` is a ``.safetensors`` file, or a directory holding
    ``model.safetensors`` or a Hugging Face shard index
    (``model.safetensors.index.json`` naming the file of each tensor). The
    files are memory-mapped and each rank copies just the box of each tensor
    its shard covers (with tensor parallelism: its rows of its TP chunk), so no
    rank materializes the model and nothing is sent.
    Tensors are cast to the model's dtypes. A model built on the meta device and
    sharded, never materialized, gets storage for this rank's shards first
    (``_meta.py``): no ``to_empty()`` needed.

    Args:
        path: file or directory, as above.
        model: the (sharded or plain) model to fill; every rank calls this.
        key_map: renames checkpoint keys to model keys: a mapping, or a
            callable returning the model key or ``None`` to skip the tensor.
        row_orders: model key -> int64 row order: row ``r`` of the model's tensor is row
            ``order[r]`` of the file's (Hugging Face's rotary layout, ``_hf.py``). A rank
            reads the span of file rows its own rows come from, never the whole tensor.

    Raises:
        ValueError: listing every model key the file lacks (a tied parameter
            needs only one of its names), every file key the model lacks, and
            every shape mismatch; raised before anything is loaded.
    """
    safetensors = import_safetensors()
    files = _resolve_files(Path(path))
    mapped = _map_keys(files, key_map)
    state = model.state_dict(keep_vars=True)  # the sharded Parameters themselves: they name their layout
    _check_keys(model, state, mapped, files)
    materialize(model)  # a model built on the meta device: storage for what the file fills
    state = model.state_dict(keep_vars=True)  # (the same objects, and buffers with storage now)
    managed: dict[int, ShardedParam] = {}
    for state_obj in {id(s): s for s in map(get_state, model.modules()) if s is not None}.values():
        for group in state_obj.groups:
            group.reshard()  # loading makes any gathered copy stale
            managed.update((id(p.sharded), p) for p in group.params)
    by_file: dict[str, list[tuple[str, str]]] = {}
    for model_key, (file, file_key) in mapped.items():
        if model_key in state:
            by_file.setdefault(file, []).append((model_key, file_key))
    with torch.no_grad():
        for file, keys in by_file.items():
            with safetensors.safe_open(file, framework="pt") as f:
                for model_key, file_key in keys:
                    target = state[model_key]
                    source = f.get_slice(file_key)
                    if row_orders and model_key in row_orders:
                        source = _Reordered(source, row_orders[model_key])
                    _copy_owned(target, managed.get(id(target)), source, model_key)


class _Reordered:
    """A safetensors slice whose rows are read in ``order``: indexing it reads only the span of
    file rows the requested rows come from."""

    def __init__(self, source: Any, order: torch.Tensor) -> None:
        self.source, self.order = source, order

    def __getitem__(self, index: Any) -> torch.Tensor:
        if not isinstance(index, tuple):
            index = (index,)
        rows = self.order[index[0]] if index else self.order
        if rows.numel() == 0:
            return self.source[(slice(0, 0), *index[1:])]
        lo, hi = int(rows.min()), int(rows.max()) + 1
        block = self.source[(slice(lo, hi), *index[1:])]  # (rows lo..hi, the other dims' box)
        return block[rows - lo]


def _resolve_files(path: Path) -> dict[str, list[str]]:
    """file -> the keys it holds (read from headers only)."""
    if path.is_dir():
        index = path / INDEX
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files: dict[str, list[str]] = {}
            for key, name in weight_map.items():
                files.setdefault(str(path / name), []).append(key)
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise FileNotFoundError(f"load_full: {index} names shard files that do not exist: {missing}")
            return files
        if (path / "model.safetensors").is_file():
            path = path / "model.safetensors"
        else:
            raise FileNotFoundError(f"load_full: {path} holds neither {INDEX} nor model.safetensors")
    if not path.is_file():
        raise FileNotFoundError(f"load_full: no such file {path}")
    return {str(path): list(_header(path))}


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"load_full: {path} is not a safetensors file (shorter than its header length)")
        size = int.from_bytes(raw, "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _map_keys(files: dict[str, list[str]], key_map: KeyMap | None) -> dict[str, tuple[str, str]]:
    """model key -> (file, file key)."""
    mapped: dict[str, tuple[str, str]] = {}
    for file, keys in files.items():
        for key in keys:
            if key_map is None:
                target = key
            elif callable(key_map):
                target = key_map(key)
            else:
                target = key_map.get(key, key)
            if target is not None:
                mapped[target] = (file, key)
    return mapped


def _check_keys(model: nn.Module, state: dict[str, torch.Tensor], mapped: dict[str, tuple[str, str]],
                files: dict[str, list[str]]) -> None:
    shapes: dict[str, list[int]] = {}
    for file in files:
        header = _header(Path(file))
        shapes.update({k: v["shape"] for k, v in header.items()})
    # Tied parameters: one name in the file is enough for all of them.
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    names_of = {name: names for names in aliases.values() for name in names}
    missing = [k for k in state if k not in mapped and not any(a in mapped for a in names_of.get(k, ()))]
    unexpected = [k for k in mapped if k not in state]
    mismatched = [f"{k}: file {shapes[mapped[k][1]]} vs model {list(state[k].shape)}"
                  for k in mapped if k in state and list(state[k].shape) != shapes[mapped[k][1]]]
    # Tied names the file lacks take their values from the name it has.
    for k in state:
        if k not in mapped:
            present = [a for a in names_of.get(k, ()) if a in mapped]
            if present:
                mapped[k] = mapped[present[0]]
    if missing or unexpected or mismatched:
        parts = [f"{label} ({len(items)}): {', '.join(items)}" for label, items in
                 (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", mismatched))
                 if items]
        raise ValueError(f"load_full: {', '.join(files)} does not match the model; " + "; ".join(parts))


def _copy_owned(target: torch.Tensor, param: ShardedParam | None, source: Any, key: str) -> None:
    """Copy the box of ``source`` (a safetensors slice) that this rank's part of ``target`` covers.

    ``param`` is fsdp2's record of ``target`` (``None`` for tensors fsdp2 does not manage):
    its :meth:`~ShardedParam.local_box` covers every layout fsdp2 builds (FSDP, HSDP, FSDP x TP).
    """
    if not isinstance(target, DTensor):
        target.copy_(source[:])
        return
    if param is not None:
        box = param.local_box()
    elif target.device_mesh.ndim == 1 and isinstance(target.placements[0], (Shard, Replicate)):
        box = _box_1d(target)
    else:
        raise NotImplementedError(f"load_full: {key!r} is a DTensor with placements {target.placements} on a "
                                  f"{target.device_mesh.ndim}-D mesh that fsdp2 does not manage; only fsdp2's "
                                  "parameters and 1-D Shard/Replicate DTensors are supported")
    local = target.to_local()
    if local.numel() > 0:
        local.copy_(source[tuple(slice(start, stop) for start, stop in box)] if box else source[:])


def _box_1d(target: DTensor) -> list[tuple[int, int]]:
    """This rank's box of a DTensor on a 1-D mesh (e.g. torch's ``fully_shard``), torch.chunk-style."""
    box = [(0, size) for size in target.shape]
    placement = target.placements[0]
    if isinstance(placement, Shard):
        n = target.shape[placement.dim]
        chunk = chunk_rows(n, target.device_mesh.size())
        start = min(target.device_mesh.get_local_rank() * chunk, n)
        box[placement.dim] = (start, min(start + chunk, n))
    return box
