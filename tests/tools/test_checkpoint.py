"""Checkpoints: torch.distributed.checkpoint on fsdp2 models, and the fsdp2.checkpoint helpers.

Every round trip compares exact values (atol=0): a checkpoint restores bits, and resuming
training from one must be indistinguishable from never having stopped.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import shutil
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_state_dict, set_model_state_dict, set_optimizer_state_dict, set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2.checkpoint as fsdp2_ckpt
from fsdp2 import fully_shard
from tests._dist import run_on_ranks
from tests._models import Transformer, train_steps


# ---- shared helpers (run on the ranks) ----------------------------------------------------
_VOCAB = 61  # embedding and output rows split unevenly over 2 and 4 ranks (31/30, 16/16/16/13)


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _build(impl: str = "fsdp2", seed: int = 0, meta: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A sharded Transformer (blocks then root) and its AdamW; ``impl="torch"`` uses torch's FSDP2;
    ``meta``: built on the meta device and never materialized."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as shard
    else:
        shard = fully_shard
    with torch.device("meta" if meta else "cpu"):
        model = Transformer(vocab=_VOCAB, seed=seed)
    mesh = _mesh()
    for block in model.layers:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    return train_steps(model, opt, steps, vocab=_VOCAB)


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value.clone()  # AdamW's step is updated in place


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, unsharded, by FQN (collective)."""
    out = {f"model.{k}": _full(v) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for k, v in state.items():
            out[f"optim.{names[id(p)]}.{k}"] = _full(v)
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=0, rtol=0, msg=key)


def _dcp_save(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _dcp_load(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


# ---- torch.distributed.checkpoint ---------------------------------------------------------
def _save_and_resume(path: str, impl: str) -> dict:
    model, opt = _build(impl)
    _train(model, opt, range(2))
    _dcp_save(path, model, opt)
    saved = _full_state(model, opt)
    straight = _train(model, opt, range(2, 4))
    after = _full_state(model, opt)

    model, opt = _build(impl, seed=1)  # different weights: the load must overwrite all of them
    _dcp_load(path, model, opt)
    _assert_same(_full_state(model, opt), saved)
    resumed = _train(model, opt, range(2, 4))
    assert resumed == straight, (resumed, straight)  # bit-identical, not merely close
    _assert_same(_full_state(model, opt), after)
    return saved


def test_dcp_save_load_resume_is_bit_identical(tmp_path):
    run_on_ranks(_save_and_resume, 2, str(tmp_path / "ckpt"), "fsdp2")


def _load_and_compare(path: str, impl: str, want: dict[str, torch.Tensor]) -> None:
    model, opt = _build(impl, seed=1)
    _dcp_load(path, model, opt)
    _assert_same(_full_state(model, opt), want)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the 1-process load, on purpose
@pytest.mark.slow
def test_dcp_checkpoint_saved_on_2_ranks_loads_on_4_and_on_1(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_save_and_resume, 2, path, "fsdp2")[0]
    run_on_ranks(_load_and_compare, 4, path, "fsdp2", saved)
    # One process, no process group, a plain (unsharded) model: dcp reads the shards it needs.
    model = Transformer(vocab=_VOCAB, seed=1)
    sd = model.state_dict()
    dcp.load({"model": sd}, checkpoint_id=path)
    model.load_state_dict(sd)
    _assert_same({f"model.{k}": v for k, v in model.state_dict().items()},
                 {k: v for k, v in saved.items() if k.startswith("model.")})


def test_dcp_cross_loads_with_torch_fully_shard(tmp_path):
    ours, theirs = str(tmp_path / "fsdp2"), str(tmp_path / "torch")
    saved_ours = run_on_ranks(_save_and_resume, 2, ours, "fsdp2")[0]
    saved_theirs = run_on_ranks(_save_and_resume, 2, theirs, "torch")[0]
    _assert_same(saved_ours, saved_theirs)  # same training, so torch's shards hold the same values
    run_on_ranks(_load_and_compare, 2, ours, "torch", saved_ours)
    run_on_ranks(_load_and_compare, 2, theirs, "fsdp2", saved_theirs)


def _full_state_dict_options() -> None:
    model, opt = _build()
    _train(model, opt, range(2))
    want = _full_state(model, opt)
    # Full state dicts on every rank, then loaded into a fresh model (each rank keeps its rows).
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    assert all(not isinstance(v, DTensor) for v in msd.values())
    fresh, fresh_opt = _build(seed=1)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True))
    _assert_same(_full_state(fresh, fresh_opt), want)
    # Full on rank 0 only, offloaded to CPU, then broadcast from rank 0 into another fresh model.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=options)
    assert (len(msd) > 0) == (dist.get_rank() == 0)
    fresh, fresh_opt = _build(seed=2)
    # set_state_dict would treat rank 1's empty model dict as "optimizer only": load them apart.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(fresh, msd, options=options)
    set_optimizer_state_dict(fresh, fresh_opt, osd, options=options)
    _assert_same(_full_state(fresh, fresh_opt), want)
    # Sharded, offloaded to CPU.
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(cpu_offload=True))
    assert all(isinstance(v, DTensor) for v in msd.values())
    fresh, fresh_opt = _build(seed=3)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    _assert_same(_full_state(fresh, fresh_opt), want)


def test_get_and_set_state_dict_full_and_sharded_options():
    run_on_ranks(_full_state_dict_options, 2, timeout=30)



# ---- fsdp2.checkpoint.save / load -------------------------------------------------------------
def _helpers_resume(path: str) -> dict:
    model, opt = _build()
    _train(model, opt, range(1))
    fsdp2_ckpt.save(path, model, opt, extra={"step": 1})
    _train(model, opt, range(1, 2))
    fsdp2_ckpt.save(path, model, opt, extra={"step": 2, "rng": torch.get_rng_state()})  # replaces step 1
    saved = _full_state(model, opt)
    straight = _train(model, opt, range(2, 4))

    model, opt = _build(seed=1)
    extra = fsdp2_ckpt.load(path, model, opt)
    assert extra["step"] == 2 and torch.equal(extra["rng"], torch.get_rng_state())
    _assert_same(_full_state(model, opt), saved)
    assert _train(model, opt, range(2, 4)) == straight
    return saved


def test_helpers_save_load_resume_and_single_process_load(tmp_path):
    path = tmp_path / "ckpt"
    saved = run_on_ranks(_helpers_resume, 2, str(path))[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no leftovers of the first save
    # No process group, a plain model: the same call.
    model = Transformer(vocab=_VOCAB, seed=1)
    assert fsdp2_ckpt.load(path, model)["step"] == 2
    _assert_same({f"model.{k}": v for k, v in model.state_dict().items()},
                 {k: v for k, v in saved.items() if k.startswith("model.")})


def test_helpers_never_load_an_incomplete_checkpoint(tmp_path, caplog):
    path = tmp_path / "ckpt"
    model = Transformer(vocab=_VOCAB)
    fsdp2_ckpt.save(path, model, extra={"step": 1})
    want = {k: v.clone() for k, v in model.state_dict().items()}
    # A save that died before completing leaves a marker-less temporary directory: ignored.
    shutil.copytree(path, tmp_path / "ckpt.tmp-dead")
    os.remove(tmp_path / "ckpt.tmp-dead" / "fsdp2_complete.json")
    fresh = Transformer(vocab=_VOCAB, seed=1)
    assert fsdp2_ckpt.load(path, fresh) == {"step": 1}
    _assert_same(fresh.state_dict(), want)
    # The next save completes and cleans up the leftover.
    fsdp2_ckpt.save(path, model, extra={"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    # Died between moving the old checkpoint aside and renaming the new one in: the old one loads.
    os.rename(path, tmp_path / "ckpt.old-dead")
    with caplog.at_level("WARNING"):
        assert fsdp2_ckpt.load(path, Transformer(vocab=_VOCAB, seed=1)) == {"step": 2}
    assert "interrupted save" in caplog.text
    os.rename(tmp_path / "ckpt.old-dead", path)
    # A directory without the marker is refused, loudly, and never overwritten by save.
    os.remove(path / "fsdp2_complete.json")
    with pytest.raises(FileNotFoundError, match="has no completion marker"):
        fsdp2_ckpt.load(path, fresh)
    with pytest.raises(FileExistsError, match="is not an fsdp2 checkpoint"):
        fsdp2_ckpt.save(path, model)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fsdp2_ckpt.load(tmp_path / "nowhere", fresh)
    # A truncated data file is an error, not silently wrong weights: the marker's file list catches
    # it before DCP reads anything; without that list (a version 1 marker), DCP's own index does.
    fsdp2_ckpt.save(tmp_path / "good", model)
    data = next((tmp_path / "good").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(fsdp2_ckpt.CorruptCheckpointError, match=rf"{data.name} is \d+ bytes but was saved with"):
        fsdp2_ckpt.load(tmp_path / "good", fresh)
    marker = json.loads((tmp_path / "good" / "fsdp2_complete.json").read_text())
    del marker["files"]
    (tmp_path / "good" / "fsdp2_complete.json").write_text(json.dumps(marker | {"version": 1}))
    with pytest.raises(fsdp2_ckpt.CorruptCheckpointError, match=rf"{data.name} is \d+ bytes but .metadata needs"):
        fsdp2_ckpt.load(tmp_path / "good", fresh)
    fsdp2_ckpt.save(tmp_path / "model_only", model)
    with pytest.raises(ValueError, match="saved without an optimizer"):
        fsdp2_ckpt.load(tmp_path / "model_only", fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))


def _helpers_into_meta_models(dcp_path: str, full_path: str) -> None:
    model, opt = _build()
    _train(model, opt, range(2))
    fsdp2_ckpt.save(dcp_path, model, opt, extra={"step": 2})
    fsdp2_ckpt.export_full(full_path, model)
    saved = _full_state(model, opt)
    straight = _train(model, opt, range(2, 4))

    # Built on meta and sharded, never materialized; the optimizer made before the load.
    model, opt = _build(meta=True)
    params = list(model.parameters())
    assert fsdp2_ckpt.load(dcp_path, model, opt) == {"step": 2}
    assert all(p is q and p.device.type == "cpu" for p, q in zip(model.parameters(), params))
    _assert_same(_full_state(model, opt), saved)
    assert _train(model, opt, range(2, 4)) == straight  # bit-identical resume

    model, _opt = _build(meta=True)
    fsdp2_ckpt.load_full(full_path, model)
    got = {f"model.{k}": _full(v) for k, v in model.state_dict().items()}
    _assert_same(got, {k: v for k, v in saved.items() if k.startswith("model.")})


def test_helpers_load_into_a_model_built_on_the_meta_device(tmp_path):
    run_on_ranks(_helpers_into_meta_models, 2, str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors"))


class _WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("offset", torch.arange(4.0))  # in the checkpoint
        self.register_buffer("table", torch.ones(4), persistent=False)  # in none


def test_load_full_into_a_plain_meta_model_fills_what_the_file_holds(tmp_path, caplog):
    from safetensors.torch import save_file

    source = _WithBuffers()
    save_file(source.state_dict(), tmp_path / "m.safetensors")
    with torch.device("meta"):
        model = _WithBuffers()
    linear_weight = model.linear.weight
    with caplog.at_level("WARNING"):
        fsdp2_ckpt.load_full(tmp_path / "m.safetensors", model)
    _assert_same(model.state_dict(), source.state_dict())
    assert model.linear.weight is linear_weight  # the same object (an optimizer made before keeps it)
    assert model.table.is_meta and "non-persistent buffers ['table'] are on the meta device" in caplog.text


# ---- export_full / load_full / the command line ---------------------------------------------
def _export(out: str, fmt: str) -> dict:
    model, opt = _build()
    _train(model, opt, range(1))
    fsdp2_ckpt.export_full(out, model, format=fmt)
    return {k: _full(v) for k, v in model.state_dict().items()}


def _load_full_and_compare(path: str, want: dict, key_map=None) -> None:
    model, _opt = _build(seed=1)
    model.unshard()  # a gathered copy must not survive the load
    fsdp2_ckpt.load_full(path, model, key_map=key_map)
    got = {k: _full(v) for k, v in model.state_dict().items()}
    _assert_same(got, want)


def _strip_prefix(key: str) -> str:
    return key.removeprefix("transformer.")


def test_export_full_then_load_full_on_another_world_size(tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "model.safetensors"
    want = run_on_ranks(_export, 2, str(out), "safetensors")[0]
    _assert_same(load_file(out), want)  # the reference reader agrees with our streaming writer
    run_on_ranks(_export, 2, str(tmp_path / "model.pt"), "torch")
    _assert_same(torch.load(tmp_path / "model.pt", weights_only=True), want)
    run_on_ranks(_load_full_and_compare, 4, str(out), want)

    # Hugging Face layout: shards plus an index, keys renamed ("transformer." prefix) on disk.
    shards = tmp_path / "hf"
    shards.mkdir()
    keys = list(want)
    weight_map = {}
    for i, part in enumerate((keys[::2], keys[1::2])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({f"transformer.{k}": want[k] for k in part}, shards / name)
        weight_map.update({f"transformer.{k}": name for k in part})
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    run_on_ranks(_load_full_and_compare, 2, str(shards), want, _strip_prefix)


def _load_full_errors(path: str) -> None:
    model, _opt = _build()
    with pytest.raises(ValueError, match=r"missing keys \(2\): norm.weight, norm.bias; unexpected keys \(1\): "
                                         r"extra; shape mismatches \(1\): output.weight: file \[3, 32\] "
                                         r"vs model \[61, 32\]"):
        fsdp2_ckpt.load_full(path, model)


def test_load_full_lists_missing_unexpected_and_mismatched_keys(tmp_path):
    from safetensors.torch import save_file

    state = Transformer(vocab=_VOCAB).state_dict()
    del state["norm.weight"], state["norm.bias"]
    state["extra"] = torch.zeros(2)
    state["output.weight"] = torch.zeros(3, 32)
    save_file(state, tmp_path / "bad.safetensors")
    run_on_ranks(_load_full_errors, 2, str(tmp_path / "bad.safetensors"))


@pytest.mark.slow
def test_command_line_export_consolidates_without_a_process_group(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    saved = run_on_ranks(_helpers_resume, 2, str(tmp_path / "ckpt"))[0]
    out = tmp_path / "out.safetensors"
    # `python -m fsdp2.checkpoint export ...`, run as python runs it (the package's __main__ as
    # "__main__", sys.argv set) in this process, which has no process group: a fresh
    # interpreter would only add its start-up.
    assert not dist.is_initialized()
    monkeypatch.setattr(sys, "argv", ["fsdp2.checkpoint", "export", str(tmp_path / "ckpt"), str(out)])
    monkeypatch.delitem(sys.modules, "fsdp2.checkpoint.__main__", raising=False)  # as in a fresh process
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("fsdp2.checkpoint", run_name="__main__", alter_sys=True)
    assert exited.value.code == 0
    _assert_same({f"model.{k}": v for k, v in load_file(out).items()},
                 {k: v for k, v in saved.items() if k.startswith("model.")})


# ---- memory: no rank ever holds the full model -------------------------------------------------
_BIG_LAYERS, _BIG_DIM = 12, 2048  # 12 x 2048 x 2048 fp32 = 201 MB


def _peak_rss_since_reset() -> int:
    """Bytes of the peak RSS (VmHWM) since the last :func:`_reset_peak_rss`."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _reset_peak_rss() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset VmHWM to the current RSS
    return _peak_rss_since_reset()


def _big_model() -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(_BIG_DIM, _BIG_DIM, bias=False) for _ in range(_BIG_LAYERS)))
    mesh = _mesh()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model.to_empty(device="cpu")  # shards only: 1/world of the model per rank


def _export_and_load_big(path: str) -> list[int]:
    # Measure live memory, not glibc's caching: with its default dynamic mmap threshold, freed
    # 16 MB blocks (ours and gloo's temporaries) stay in the heap and RSS never goes down.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB, fixed
    source = _big_model()
    with torch.no_grad():
        for p in source.parameters():
            p.to_local().normal_(generator=torch.Generator().manual_seed(dist.get_rank()))
    base = _reset_peak_rss()
    fsdp2_ckpt.export_full(path, source)
    export_peak = _peak_rss_since_reset() - base

    target = _big_model()
    base = _reset_peak_rss()
    fsdp2_ckpt.load_full(path, target)
    load_peak = _peak_rss_since_reset() - base
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        torch.testing.assert_close(b.to_local(), a.to_local(), atol=0, rtol=0, msg=name)
    return [export_peak, load_peak]


def test_export_full_and_load_full_peak_memory_is_far_below_the_model(tmp_path):
    full_bytes = _BIG_LAYERS * _BIG_DIM * _BIG_DIM * 4
    peaks = run_on_ranks(_export_and_load_big, 4, str(tmp_path / "big.safetensors"), timeout=240)
    assert os.path.getsize(tmp_path / "big.safetensors") > full_bytes
    export_peaks, load_peaks = zip(*peaks)
    # Export: rank 0 holds about one gathered 16 MB layer (plus gather buffers), not 201 MB.
    assert max(export_peaks) < 0.25 * full_bytes, (export_peaks, full_bytes)
    # Load: each rank touches only its quarter of the file (mapped pages) plus one slice.
    assert max(load_peaks) < 0.4 * full_bytes, (load_peaks, full_bytes)
