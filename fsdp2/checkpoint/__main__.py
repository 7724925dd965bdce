"""``python -m fsdp2.checkpoint export DIR OUT.safetensors`` and ``verify DIR``: offline, one process.

``export`` consolidates a DCP checkpoint with no process group: reads the checkpoint's
metadata, then loads one tensor at a time (DCP assembles it from every rank's shards) and
streams it into a safetensors file, so memory stays about one tensor.

``export-hf`` does the same for a checkpoint of fsdp2's Llama (the recipe's model), writing a
Hugging Face ``LlamaForCausalLM`` folder (``config.json`` plus safetensors shards): the model's
shape comes from ``--hf-config`` (e.g. the config.json of the model the run fine-tuned) or from
the tensors' shapes and ``--n-heads``.

``verify`` runs :func:`fsdp2.checkpoint.verify` (sizes, ``.metadata``, every file's CRC-32:
what a resuming run checks) on a checkpoint, or on every checkpoint of a run's directory,
and prints one line per checkpoint; exit status 0 when all are sound, 1 otherwise.

``DIR`` is a checkpoint (a directory with DCP's ``.metadata``), or a training run's
checkpoint directory holding one checkpoint per subdirectory named by its step
(``step-00000300``, ``step-300``, ``checkpoint_300``...): the newest sound one is exported,
skipping any that :func:`fsdp2.checkpoint.verify` finds damaged.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..models.llama import ModelArgs
from ._dcp import MARKER, single_process_ok, verify
from ._hf import DEFAULT_SHARD_BYTES, DTYPE_NAMES, hf_names, model_args_from_hf, write_hf
from ._safetensors import StreamingWriter


def export(dcp_dir: str, out: str, prefix: str | None = None) -> list[str]:
    """Write the tensors under ``prefix`` (default ``"model."`` if present) to ``out``; return their keys."""
    reader = dcp.FileSystemReader(dcp_dir)
    metadata = reader.read_metadata()
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    if prefix is None:
        prefix = "model." if any(k.startswith("model.") for k in tensors) else ""
    chosen = {k: v for k, v in tensors.items() if k.startswith(prefix)}
    if not chosen:
        raise SystemExit(f"no tensors under prefix {prefix!r} in {dcp_dir}; keys: {sorted(tensors)[:10]}")
    specs = {k[len(prefix):]: (torch.Size(v.size), v.properties.dtype) for k, v in chosen.items()}
    tmp = f"{out}.tmp"
    with open(tmp, "wb") as f:
        writer = StreamingWriter(f, specs, {"format": "pt"})
        for key, meta in chosen.items():
            tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
            with single_process_ok():
                dcp.load({key: tensor}, storage_reader=dcp.FileSystemReader(dcp_dir), no_dist=True)
            writer.write(key[len(prefix):], tensor)
        writer.close()
    os.replace(tmp, out)
    return list(specs)


def _dcp_tensors(dcp_dir: str, prefix: str | None) -> tuple[str, dict[str, TensorStorageMetadata]]:
    """(the prefix used, key without it -> metadata) of the checkpoint's tensors under ``prefix``
    (default ``"model."`` when present)."""
    metadata = dcp.FileSystemReader(dcp_dir).read_metadata()
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    if prefix is None:
        prefix = "model." if any(k.startswith("model.") for k in tensors) else ""
    chosen = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    if not chosen:
        raise SystemExit(f"no tensors under prefix {prefix!r} in {dcp_dir}; keys: {sorted(tensors)[:10]}")
    return prefix, chosen


def _read_tensor(dcp_dir: str, key: str, meta: TensorStorageMetadata) -> torch.Tensor:
    tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
    with single_process_ok():
        dcp.load({key: tensor}, storage_reader=dcp.FileSystemReader(dcp_dir), no_dist=True)
    return tensor


def _shape_args(tensors: dict[str, TensorStorageMetadata], n_heads: int | None, **fields: object) -> ModelArgs:
    """fsdp2 Llama's shape from the checkpoint's tensors and the head count (which shapes cannot tell)."""
    if n_heads is None:
        raise SystemExit("export-hf: give --hf-config CONFIG_JSON, or --n-heads N (the tensors' shapes do not tell "
                         "how many heads the model has)")
    if "tok_embeddings.weight" not in tensors:
        raise SystemExit(f"export-hf: no tok_embeddings.weight in the checkpoint: not fsdp2's Llama "
                         f"(keys: {sorted(tensors)[:5]})")
    vocab, dim = tensors["tok_embeddings.weight"].size
    layers = {int(m.group(1)) for k in tensors if (m := re.match(r"layers\.(\d+)\.", k))}
    head_dim = dim // n_heads
    return ModelArgs(dim=dim, n_layers=len(layers), n_heads=n_heads, vocab_size=vocab,
                     n_kv_heads=tensors["layers.0.attention.wk.weight"].size[0] // head_dim,
                     ffn_hidden_size=tensors["layers.0.feed_forward.w1.weight"].size[0],
                     tie_embeddings="output.weight" not in tensors, **fields)


def export_hf_offline(dcp_dir: str, out: str, *, hf_config: str | None = None, n_heads: int | None = None,
                      dtype: str = "float32", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                      prefix: str | None = None, **fields: object) -> list[str]:
    """Write the checkpoint's fsdp2 Llama as a Hugging Face folder ``out``, one tensor in memory at a time."""
    prefix, tensors = _dcp_tensors(dcp_dir, prefix)
    args = model_args_from_hf(hf_config, **fields) if hf_config else _shape_args(tensors, n_heads, **fields)
    if missing := [name for name in hf_names(args).values() if name not in tensors]:
        raise SystemExit(f"export-hf: {dcp_dir} has no {missing[0]} (the model of {hf_config or 'these shapes'} "
                         "needs it)")
    return write_hf(out, args, lambda key: _read_tensor(dcp_dir, prefix + key, tensors[key]),
                    dtype=DTYPE_NAMES[dtype], max_shard_bytes=max_shard_bytes)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a byte count -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 5GB, 500MB, 2GiB, or bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


_NUMBERED = re.compile(r"^[A-Za-z_-]*?(\d+)$")  # step-00000300, step-300, checkpoint_300; not step-3.tmp-1


def _numbered(path: Path) -> list[Path]:
    """The subdirectories of ``path`` whose names end in a number, by that number."""
    numbered = sorted((int(m.group(1)), child) for child in path.iterdir()
                      if child.is_dir() and (m := _NUMBERED.match(child.name)))
    return [child for _, child in numbered]


def find_checkpoint(path: str | os.PathLike) -> tuple[Path, list[str]]:
    """The checkpoint to read at ``path``, and what was passed over on the way (for the user).

    ``path`` itself when it holds DCP's ``.metadata``; otherwise the subdirectory with the
    highest number at the end of its name that is sound (fsdp2 checkpoints must pass
    :func:`fsdp2.checkpoint.verify`, plain DCP ones need a ``.metadata``).

    Raises:
        ValueError: ``path`` is not a checkpoint and holds no sound numbered checkpoint.
    """
    path = Path(path)
    if (path / ".metadata").is_file():
        problems = verify(path) if (path / MARKER).is_file() else []
        if problems:
            raise ValueError(f"{path} is damaged: {'; '.join(problems)}")
        return path, []
    if not path.is_dir():
        raise ValueError(f"{path} does not exist" if not path.exists() else f"{path} is not a directory")
    skipped = []
    for child in reversed(_numbered(path)):
        if (child / MARKER).is_file():
            problems = verify(child)
        else:
            problems = [] if (child / ".metadata").is_file() else ["no .metadata (not a complete DCP checkpoint)"]
        if not problems:
            return child, skipped
        skipped.append(f"skipped {child.name}: {'; '.join(problems)}")
    found = "; ".join(skipped) if skipped else "no .metadata file and no numbered checkpoint directories in it"
    raise ValueError(f"{path} is not a DCP checkpoint and holds no sound one: {found}")


def verify_all(path: str | os.PathLike) -> tuple[list[str], bool]:
    """(one line per checkpoint at ``path``: sound, or what is wrong; whether all are sound).

    ``path`` is a checkpoint (it holds the completion marker or ``.metadata``) or a directory
    of numbered ones (a run's ``step-N``), checked oldest first. Raises ValueError when
    ``path`` is not a directory.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} does not exist" if not path.exists() else f"{path} is not a directory")
    if (path / MARKER).is_file() or (path / ".metadata").is_file():
        checkpoints = [path]
    else:
        checkpoints = _numbered(path)
    if not checkpoints:
        return [f"{path}: no checkpoint in it (neither {MARKER} nor numbered checkpoint directories)"], False
    lines, sound = [], True
    for checkpoint in checkpoints:
        name = checkpoint.name if checkpoint != path else str(path)
        if problems := verify(checkpoint):
            sound = False
            lines.append(f"{name}: unusable: {'; '.join(problems)}")
            continue
        marker = json.loads((checkpoint / MARKER).read_text())
        files = marker.get("files", {})
        checked = "CRC-32 checked" if "crc32" in marker else "sizes checked; saved before checkpoints kept checksums"
        lines.append(f"{name}: sound ({len(files)} files, {sum(files.values()) / 2**20:.1f} MiB, {checked})")
    return lines, sound


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp2.checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("export", help="consolidate a DCP checkpoint into one safetensors file")
    cmd.add_argument("dcp_dir", metavar="DIR",
                     help="a DCP checkpoint directory (e.g. one written by fsdp2.checkpoint.save), or a run's "
                          "checkpoint directory of step-N checkpoints: the newest sound one is exported")
    cmd.add_argument("out", help="the .safetensors file to write")
    cmd.add_argument("--prefix", default=None,
                     help="export the tensors whose key starts with this, stripping it "
                          "(default: 'model.' when present, else everything)")
    _add_export_hf(commands)
    cmd = commands.add_parser("verify", help="check checkpoints as a resuming run does (sizes, .metadata, "
                                             "checksums): one line each; exit status 0 when all are sound, else 1")
    cmd.add_argument("dir", metavar="DIR", help="a checkpoint directory, or a run's checkpoint directory of step-N "
                                                "checkpoints (each is checked)")
    args = parser.parse_args(argv)
    if args.command == "verify":
        try:
            lines, sound = verify_all(args.dir)
        except ValueError as e:
            parser.error(str(e))
        print("\n".join(lines))
        return 0 if sound else 1
    try:
        source, skipped = find_checkpoint(args.dcp_dir)
    except ValueError as e:
        parser.error(str(e))
    for line in skipped:
        print(line, file=sys.stderr)
    if args.command == "export-hf":
        fields = {k: v for k, v in (("max_seq_len", args.max_seq_len), ("rope_theta", args.rope_theta),
                                    ("norm_eps", args.norm_eps)) if v is not None}
        try:
            files = export_hf_offline(str(source), args.out, hf_config=args.hf_config, n_heads=args.n_heads,
                                      dtype=args.dtype, max_shard_bytes=args.max_shard_size, prefix=args.prefix,
                                      **fields)
        except ValueError as e:
            parser.error(str(e))
        print(f"wrote a Hugging Face model ({args.dtype}) from {source} to {args.out}: {', '.join(files)}")
        return 0
    keys = export(str(source), args.out, args.prefix)
    print(f"wrote {len(keys)} tensors from {source} to {args.out}")
    return 0


def _add_export_hf(commands: argparse._SubParsersAction) -> None:
    cmd = commands.add_parser("export-hf", help="write a checkpoint of fsdp2's Llama (the recipe's model) as a "
                                                "Hugging Face LlamaForCausalLM folder")
    cmd.add_argument("dcp_dir", metavar="CHECKPOINT",
                     help="a DCP checkpoint directory, or a run's checkpoint directory (its newest sound one)")
    cmd.add_argument("out", metavar="DIR", help="the folder to write (config.json and safetensors)")
    cmd.add_argument("--hf-config", metavar="CONFIG_JSON", default=None,
                     help="the model's shape from this config.json (e.g. that of the model the run fine-tuned)")
    cmd.add_argument("--n-heads", type=int, default=None,
                     help="without --hf-config: the attention heads (the rest is read from the tensors' shapes)")
    cmd.add_argument("--rope-theta", type=float, default=None, help="without --hf-config: the rotary base (10000)")
    cmd.add_argument("--norm-eps", type=float, default=None, help="without --hf-config: RMSNorm's epsilon (1e-5)")
    cmd.add_argument("--max-seq-len", type=int, default=None, help="max_position_embeddings to record")
    cmd.add_argument("--dtype", choices=list(DTYPE_NAMES), default="float32", help="the stored dtype")
    cmd.add_argument("--max-shard-size", type=_size, default=DEFAULT_SHARD_BYTES,
                     help="largest safetensors file; larger models get shards and an index (default 5GiB)")
    cmd.add_argument("--prefix", default=None, help="the model's tensors' key prefix (default: 'model.' if present)")


if __name__ == "__main__":
    sys.exit(main())
