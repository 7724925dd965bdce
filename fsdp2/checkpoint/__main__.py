"""``python -m fsdp2.checkpoint export DCP_DIR OUT.safetensors``: consolidate a DCP checkpoint offline.

Runs in one process with no process group: reads the checkpoint's metadata,
then loads one tensor at a time (DCP assembles it from every rank's shards) and
streams it into a safetensors file, so memory stays about one tensor.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ._dcp import single_process_ok
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp2.checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("export", help="consolidate a DCP checkpoint into one safetensors file")
    cmd.add_argument("dcp_dir", help="the DCP checkpoint directory (e.g. one written by fsdp2.checkpoint.save)")
    cmd.add_argument("out", help="the .safetensors file to write")
    cmd.add_argument("--prefix", default=None,
                     help="export the tensors whose key starts with this, stripping it "
                          "(default: 'model.' when present, else everything)")
    args = parser.parse_args(argv)
    if not Path(args.dcp_dir, ".metadata").is_file():
        parser.error(f"{args.dcp_dir} is not a DCP checkpoint (no .metadata file)")
    keys = export(args.dcp_dir, args.out, args.prefix)
    print(f"wrote {len(keys)} tensors to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
