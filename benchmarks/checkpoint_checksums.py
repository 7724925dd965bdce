"""What checkpoint checksums cost: a save with and without the CRC-32 sums, a resume's checks and load.

One process, no process group, a model of ``--params`` fp32 parameters in 8 linear layers
with AdamW's state (so the checkpoint is about 3 x 4 bytes x params), written to ``--dir``.
Each round, interleaved:

- ``save_plain``: ``dcp.save`` through a plain ``FileSystemWriter`` (what a save cost before).
- ``save_summed``: the same writer with fsdp2's summing backend (what ``fsdp2.checkpoint.save``
  now does while writing).
- ``verify_sizes`` / ``verify_content``: ``fsdp2.checkpoint.verify`` without and with the
  checksums (the content check reads the whole checkpoint once; the page cache is warm, as
  it is right after a save or on a resume that follows one).
- ``load_unchecked`` / ``load_checked``: ``fsdp2.checkpoint.load`` with ``check_content``
  off and on (a resume's load; on several ranks the content check is spread over them).

Prints one JSON line with the minimum of each over ``--rounds``.

    python benchmarks/checkpoint_checksums.py --params 32000000 --rounds 5 --dir /tmp/ckbench
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import fsdp2.checkpoint as ckpt
from fsdp2.checkpoint._checksum import ChecksummingFileSystem
from fsdp2.checkpoint._dcp import single_process_ok


def _setup(params: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = int((params / 8) ** 0.5)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(8)])
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return model, optimizer


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _dcp_save(path: Path, state: dict, summed: bool) -> None:
    writer = dcp.FileSystemWriter(str(path))
    if summed:
        writer.fs = ChecksummingFileSystem(writer.fs, path)
    with single_process_ok():
        dcp.save(state, storage_writer=writer, no_dist=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=32_000_000, help="parameters (fp32) of the model saved")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; each figure is their minimum")
    parser.add_argument("--dir", default="/tmp/fsdp2-checksum-bench", help="where to write (removed at the end)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    model, optimizer = _setup(args.params)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    times: dict[str, list[float]] = {}
    for i in range(args.rounds):
        for summed in (False, True) if i % 2 == 0 else (True, False):
            path = root / f"dcp-{summed}"
            shutil.rmtree(path, ignore_errors=True)
            times.setdefault("save_summed" if summed else "save_plain", []).append(
                _timed(lambda: _dcp_save(path, state, summed)))
        checkpoint = root / "fsdp2"
        shutil.rmtree(checkpoint, ignore_errors=True)
        ckpt.save(checkpoint, model, optimizer)
        times.setdefault("verify_sizes", []).append(_timed(lambda: ckpt.verify(checkpoint, content=False)))
        times.setdefault("verify_content", []).append(_timed(lambda: ckpt.verify(checkpoint)))
        times.setdefault("load_unchecked", []).append(
            _timed(lambda: ckpt.load(checkpoint, model, optimizer, check_content=False)))
        times.setdefault("load_checked", []).append(_timed(lambda: ckpt.load(checkpoint, model, optimizer)))
    size = sum(f.stat().st_size for f in (root / "fsdp2").iterdir())
    print(json.dumps({"params": args.params, "checkpoint_mib": round(size / 2**20, 1), "rounds": args.rounds,
                      "torch": torch.__version__, **{k: round(min(v), 3) for k, v in times.items()}}))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
