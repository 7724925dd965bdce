"""``python -m fsdp2.checkpoint export DIR OUT.safetensors`` and ``verify DIR``: offline, one process.

``export`` consolidates a DCP checkpoint with no process group: reads the checkpoint's
metadata, then loads one tensor at a time (DCP assembles it from every rank's shards) and
streams it into a safetensors file, so memory stays about one tensor.

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

from ._dcp import MARKER, single_process_ok, verify
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
    keys = export(str(source), args.out, args.prefix)
    print(f"wrote {len(keys)} tensors from {source} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
