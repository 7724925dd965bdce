"""Checkpoints verified by content: CRC-32 sums taken as the save writes, checked before a load.

- ``fsdp2.checkpoint.save`` records every file's CRC-32 in the completion marker without
  reading any file back (the read-back function is made to fail during the save), on one
  process and on 2 ranks (each rank sums the files it writes; rank 0 gathers them), and the
  sums equal those of the files on disk.
- Bytes overwritten in place (same size) pass the size checks but fail ``verify``;
  ``load`` refuses the checkpoint on every rank with the same error, naming the file, and
  ``verify_on_ranks`` gives every rank the same list.
- ``python -m fsdp2.checkpoint verify DIR``: one line per checkpoint, exit status 0 when all
  are sound, 1 otherwise, 2 for a path that is not a directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import fsdp2.checkpoint as ckpt
import fsdp2.checkpoint._dcp as dcp_module
from fsdp2 import fully_shard
from fsdp2.checkpoint.__main__ import main as checkpoint_command
from fsdp2.checkpoint._checksum import crc32_of_file
from tests._dist import REPO_ROOT, run_on_ranks
from tests.reliability._faulty_train import overwrite_in_place

MARKER = "fsdp2_complete.json"


def _model(*, shard: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    if shard:
        for layer in (model[0], model[2], model):
            fully_shard(layer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save_without_reading_back(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    def read_back(file) -> int:
        raise AssertionError(f"save read {file} back to sum it")

    dcp_module.crc32_of_file = read_back
    try:
        ckpt.save(path, model, optimizer, extra={"step": 7})
    finally:
        dcp_module.crc32_of_file = crc32_of_file


def _sums_match_the_files(path: Path) -> dict:
    marker = json.loads((path / MARKER).read_text())
    assert marker["version"] == 3 and sorted(marker["crc32"]) == sorted(marker["files"])
    assert marker["crc32"] == {name: crc32_of_file(path / name) for name in marker["files"]}
    return marker


def test_save_sums_every_file_as_it_writes_it(tmp_path):
    model, optimizer = _model()
    _save_without_reading_back(tmp_path / "c", model, optimizer)
    assert sorted(_sums_match_the_files(tmp_path / "c")["files"]) == [".metadata", "__0_0.distcp"]
    assert ckpt.verify(tmp_path / "c") == []


def _sharded_save_and_damage(root: str) -> list[str]:
    """2 ranks: save a sharded model (sums checked), damage rank 1's file in place, verify and load."""
    model, optimizer = _model(shard=True)
    path = Path(root) / "c"
    _save_without_reading_back(path, model, optimizer)
    if dist.get_rank() == 0:
        assert sorted(_sums_match_the_files(path)["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        overwrite_in_place(path / "__1_0.distcp")
    dist.barrier()
    problems = ckpt.verify_on_ranks(path)
    assert ckpt.verify_on_ranks(path, content=False) == []
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"c is corrupted: __1_0.distcp does not match its checksum"):
        ckpt.load(path, model, optimizer)
    with pytest.raises(dcp.CheckpointException):  # unchecked, DCP itself meets the damage (how it did before)
        ckpt.load(path, model, optimizer, check_content=False)
    return problems


def test_same_size_damage_is_found_on_every_rank_before_dcp_reads(tmp_path):
    results = run_on_ranks(_sharded_save_and_damage, 2, str(tmp_path), timeout=120.0)
    assert results[0] == results[1]
    problems = results[0]
    assert len(problems) == 1 and problems[0].startswith("__1_0.distcp does not match its checksum (CRC-32 ")
    assert problems[0].endswith("): overwritten or corrupted after the save")


def test_same_size_damage_passes_the_size_checks_but_not_verify(tmp_path):
    model, optimizer = _model()
    ckpt.save(tmp_path / "c", model, optimizer)
    size = (tmp_path / "c" / "__0_0.distcp").stat().st_size
    overwrite_in_place(tmp_path / "c" / "__0_0.distcp")
    assert (tmp_path / "c" / "__0_0.distcp").stat().st_size == size
    assert ckpt.verify(tmp_path / "c", content=False) == []
    assert [p.split(" (")[0] for p in ckpt.verify(tmp_path / "c")] == ["__0_0.distcp does not match its checksum"]
    with pytest.raises(ckpt.CorruptCheckpointError, match="does not match its checksum"):
        ckpt.load(tmp_path / "c", model, optimizer)


# ---- python -m fsdp2.checkpoint verify ----------------------------------------------------------
def _verify(path: Path, capsys) -> tuple[int, str]:
    """``verify`` in this process (the command itself runs once, below): exit status and output."""
    try:
        status = checkpoint_command(["verify", str(path)])
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    assert err == "" or status == 2
    return status, out


def test_verify_command_prints_one_line_per_checkpoint(tmp_path, capsys):
    model, optimizer = _model()
    run = tmp_path / "run"
    for step in (1, 2, 3, 10):
        ckpt.save(run / f"step-{step:08d}", model, optimizer)
    overwrite_in_place(run / "step-00000002" / "__0_0.distcp")
    (run / "step-00000003" / MARKER).unlink()
    old = json.loads((run / "step-00000010" / MARKER).read_text())  # as saved before markers kept sums
    del old["crc32"]
    (run / "step-00000010" / MARKER).write_text(json.dumps(old))
    (run / "step-00000004.tmp-0123456789ab").mkdir()  # not a checkpoint: not listed

    proc = subprocess.run([sys.executable, "-m", "fsdp2.checkpoint", "verify", str(run)], capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 1 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("step-00000001: sound (2 files, ") and lines[0].endswith(" MiB, CRC-32 checked)")
    assert lines[1].startswith("step-00000002: unusable: __0_0.distcp does not match its checksum (CRC-32 ")
    assert lines[2] == (f"step-00000003: unusable: {run / 'step-00000003'} has no completion marker {MARKER} "
                        "(an interrupted or foreign save)")
    assert lines[3].endswith(" MiB, sizes checked; saved before checkpoints kept checksums)")

    status, out = _verify(run / "step-00000001", capsys)
    assert status == 0 and out.startswith(f"{run / 'step-00000001'}: sound (2 files, ") and out.count("\n") == 1
    assert _verify(tmp_path / "missing", capsys)[0] == 2
    (tmp_path / "empty").mkdir()
    status, out = _verify(tmp_path / "empty", capsys)
    assert status == 1 and out.startswith(f"{tmp_path / 'empty'}: no checkpoint in it")
