"""Async checkpoints (``fsdp2.checkpoint.AsyncSaver``): written in the background, as sound as ``save``'s.

- Every mode round-trips exactly on 2 gloo ranks while training goes on during the write:
  the checkpoint holds the state at the save, not a later one, and passes ``verify_on_ranks``.
- At most one save is in flight: a second save returns only once the first is complete.
- The staging buffers are reused: over 20 saves every staged tensor keeps its address and
  the process's resident memory does not grow by the staged size per save.
- Without a process group too; a bad mode is a ValueError naming the modes; ``pinned``
  without CUDA says so in the log.
- ``benchmarks/checkpoint_async.py`` runs on a tiny model and prints its JSON line.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2.checkpoint as fsdp2_ckpt
from fsdp2 import _compat, fully_shard
from recipes.config import ConfigError, parse_args
from tests._dist import REPO_ROOT, run_on_ranks
from tests.tools.test_checkpoint import _assert_same, _build, _full_state, _train

MARKER = "fsdp2_complete.json"


def _rss_mib() -> float:
    """This process's resident memory now (Linux: /proc), in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


# ---- every mode round-trips, with training going on during the write -----------------------------
def _save_train_load(root: str, mode: str) -> dict:
    model, opt = _build()
    _train(model, opt, range(2))
    saved = _full_state(model, opt)
    with fsdp2_ckpt.AsyncSaver(mode) as saver:
        handle = saver.save(f"{root}/a", model, opt, extra={"step": 2})
        _train(model, opt, range(2, 4))  # while the write goes on (async): must not reach the checkpoint
        handle.wait()
    assert handle.done() and handle.written_s is not None and handle.blocked_s >= handle.waited_s
    assert fsdp2_ckpt.verify_on_ranks(f"{root}/a") == []
    model, opt = _build(seed=1)
    assert fsdp2_ckpt.load(f"{root}/a", model, opt) == {"step": 2}
    _assert_same(_full_state(model, opt), saved)
    return json.loads(open(f"{root}/a/{MARKER}").read())


@pytest.mark.parametrize("mode", ["off", "async", "pinned"])
def test_a_save_holds_the_state_at_the_save_while_training_goes_on(tmp_path, mode):
    markers = run_on_ranks(_save_train_load, 2, str(tmp_path), mode)
    assert markers[0]["world_size"] == 2 and markers[0]["optimizer"] and markers[0]["extra"]
    assert sorted(markers[0]["crc32"]) == sorted(markers[0]["files"])  # every file summed
    assert not list(tmp_path.glob("a.tmp-*"))


# ---- at most one save in flight; the buffers are reused ----------------------------------------
def _staged_addresses(saver: fsdp2_ckpt.AsyncSaver) -> list[list[int]]:
    """Record, for each save, the addresses of the tensors the saver's stager hands to DCP."""
    stager = saver._staging()
    stage, seen = stager.stage, []

    def recording(state_dict, **kwargs):
        staged = stage(state_dict, **kwargs)
        tensors = [*staged["model"].values(), *(v for s in staged["optim"]["state"].values() for v in s.values())]
        seen.append(sorted(t.to_local().data_ptr() if hasattr(t, "to_local") else t.data_ptr() for t in tensors))
        return staged

    stager.stage = recording
    return seen


def _twenty_saves(root: str) -> tuple[list[float], float]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)))  # ~1M parameters: 6 MiB staged per rank
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rss, previous = [], None
    with fsdp2_ckpt.AsyncSaver("async") as saver:
        addresses = _staged_addresses(saver)
        for i in range(20):
            model(torch.randn(8, 512)).sum().backward()
            opt.step()
            opt.zero_grad()
            handle = saver.save(f"{root}/step-{i}", model, opt)
            if previous is not None:
                assert previous.done(), "the previous save is complete before the next one starts"
                if dist.get_rank() == 0:
                    shutil.rmtree(f"{root}/step-{i - 1}")
            previous = handle
            rss.append(_rss_mib())
    if _compat.DCP_STAGER_REUSABLE:  # (before torch 2.13 a stager serves one save: new buffers, freed after it)
        assert len(addresses) == 20 and all(a == addresses[0] for a in addresses), "staging buffers reallocated"
    staged = sum(p.numel() for p in model.parameters()) * 3 * 4 / dist.get_world_size() / 2**20
    return rss, staged


def test_twenty_async_saves_reuse_their_staging_buffers_and_keep_memory_flat(tmp_path):
    for rss, staged in run_on_ranks(_twenty_saves, 2, str(tmp_path), timeout=240.0):
        # Allocating anew for each save and keeping it would add `staged` MiB per save: 18 x 6 MiB.
        assert rss[-1] - rss[1] < 3 * staged, (rss, staged)
    assert [p.name for p in tmp_path.iterdir()] == ["step-19"]


# ---- one process, errors, logs -------------------------------------------------------------------
def test_async_save_without_a_process_group(tmp_path):
    model = nn.Linear(8, 4)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with fsdp2_ckpt.AsyncSaver("async") as saver:
        saver.save(tmp_path / "c", model, extra={"note": "one"})
        with torch.no_grad():
            model.weight.add_(1.0)  # after staging: not in the checkpoint
        first = saver.wait()
        assert first is not None and first.done() and saver.wait() is None
    assert fsdp2_ckpt.verify(tmp_path / "c") == []
    fresh = nn.Linear(8, 4)
    assert fsdp2_ckpt.load(tmp_path / "c", fresh) == {"note": "one"}
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, want[key], atol=0, rtol=0)


def test_a_bad_async_mode_names_the_modes():
    with pytest.raises(ValueError, match=r"async_mode must be one of 'off', 'async', 'pinned', got 'fast'"):
        fsdp2_ckpt.AsyncSaver("fast")


def test_pinned_says_in_the_log_what_it_does_without_cuda(caplog):
    with caplog.at_level(logging.INFO, logger="fsdp2.checkpoint"):
        fsdp2_ckpt.AsyncSaver("pinned").close()
    said = any("staging in ordinary host memory" in r.getMessage() for r in caplog.records)
    assert said == (not torch.cuda.is_available())


# ---- the benchmark runs ----------------------------------------------------------------------------
@pytest.mark.slow  # a torchrun launch
def test_the_async_benchmark_runs_and_prints_its_figures(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO_ROOT / "benchmarks" / "checkpoint_async.py"), "--params", "400000", "--saves", "1",
           "--steps-between", "1", "--repeats", "1", "--dir", str(tmp_path / "bench")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(line)
    assert set(result["blocked_s"]) == {"off", "async", "pinned"} and result["ranks"] == 2
    assert result["checkpoint_mib"] > 0 and result["disk_write_mib_s"] > 0 and result["save_of_disk"] > 0
    assert not (tmp_path / "bench").exists()


def test_the_recipe_refuses_a_bad_async_mode_naming_the_modes():
    with pytest.raises(ConfigError, match=r"checkpoint\.async_mode must be one of 'off', 'async', 'pinned', got "
                                          r"'fast' \(from --checkpoint\.async_mode=fast\)"):
        parse_args(["--checkpoint.async_mode=fast"])
    assert parse_args(["--checkpoint.async_mode=pinned"]).checkpoint.async_mode == "pinned"
    assert parse_args([]).checkpoint.async_mode == "off"
