"""Checkpoints of 2-D layouts: HSDP on a (replicate, shard) mesh, and FSDP x tensor parallel.

Round trips compare exact values (atol=0) and resumed training must repeat the losses of never
having stopped. Full-tensor loads (``load_full``, ``load_state_dict`` with plain tensors) are
checked against ``distribute_tensor`` (what DTensor says each rank holds) and ``full_tensor()``.
Sizes are uneven on purpose: vocab 31 or 61 over the shard axis, and an FFN width of 38 that TP
cuts to 19 rows per rank, which FSDP then cuts into 10 and 9.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp2.checkpoint as fsdp2_ckpt
from fsdp2.checkpoint.__main__ import export
from fsdp2 import fully_shard
from tests._dist import run_on_ranks
from tests.parallel.test_2d import Attention
from tests.tools.test_checkpoint import _assert_same, _dcp_load, _dcp_save
from tests._models import Transformer, train_steps

LAYOUTS = ["hsdp", "fsdp_tp"]


# ---- models (a Llama-ish block whose projections tensor parallelism can split) -----------------
class _Block(nn.Module):
    def __init__(self, dim: int = 16, n_heads: int = 4, hidden: int = 38) -> None:
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.w2(F.silu(self.w1(self.ffn_norm(x))))


class _Llama(nn.Module):
    def __init__(self, vocab: int = 31, dim: int = 16, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.emb = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList([_Block(dim), _Block(dim)])
            self.out = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


_TP_PLAN = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(), "w1": ColwiseParallel(), "w2": RowwiseParallel()}
_HSDP_VOCAB, _TP_VOCAB = 61, 31


def _plain(layout: str, seed: int = 0) -> nn.Module:
    if layout == "hsdp":
        return Transformer(vocab=_HSDP_VOCAB, n_layers=2, seed=seed)
    return _Llama(vocab=_TP_VOCAB, seed=seed)


def _mesh(layout: str) -> DeviceMesh:
    names = ("dp_replicate", "dp_shard") if layout == "hsdp" else ("dp", "tp")
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=names)


def _shard(model: nn.Module, layout: str, mesh: DeviceMesh) -> nn.Module:
    """HSDP over the whole (replicate, shard) mesh, or TP on "tp" then FSDP on "dp" (TP first, as FSDP
    shards the TP-local tensors)."""
    dp_mesh = mesh if layout == "hsdp" else mesh["dp"]
    for layer in model.layers:
        if layout == "fsdp_tp":
            parallelize_module(layer, mesh["tp"], _TP_PLAN)
        fully_shard(layer, mesh=dp_mesh)
    return fully_shard(model, mesh=dp_mesh)


def _build(layout: str, mesh: DeviceMesh, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _shard(_plain(layout, seed), layout, mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer, layout: str, steps: range) -> list[float]:
    # TP ranks of one data-parallel replica must see the same batch.
    data_rank = dist.get_rank() if layout == "hsdp" else dist.get_rank() // 2
    return train_steps(model, opt, steps, vocab=_HSDP_VOCAB if layout == "hsdp" else _TP_VOCAB, seq=8,
                       data_rank=data_rank)


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value.clone()  # AdamW's step changes in place


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local().clone() if isinstance(value, DTensor) else value.clone()


def _state(model: nn.Module, opt: torch.optim.Optimizer, gather: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor by FQN: this rank's pieces, or unsharded (collective)."""
    get = _full if gather else _local
    out = {f"model.{k}": get(v) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for k, v in state.items():
            out[f"optim.{names[id(p)]}.{k}"] = get(v)
    return out


def _model_only(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}


def _helpers_load(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    assert fsdp2_ckpt.load(path, model, opt) == {"step": 1}


# ---- save -> load -> resume ---------------------------------------------------------------------
def _save_load_resume(tmp: str, layout: str) -> None:
    mesh = _mesh(layout)
    model, opt = _build(layout, mesh)
    _train(model, opt, layout, range(1))
    _dcp_save(f"{tmp}/dcp", model, opt)
    fsdp2_ckpt.save(f"{tmp}/helpers", model, opt, extra={"step": 1})
    saved = _state(model, opt)  # same layout: this rank's pieces must come back exactly
    straight = _train(model, opt, layout, range(1, 3))
    after = _state(model, opt)

    for load, path in ((_dcp_load, f"{tmp}/dcp"), (_helpers_load, f"{tmp}/helpers")):
        model, opt = _build(layout, mesh, seed=1)  # other weights: the load must overwrite all of them
        load(path, model, opt)
        _assert_same(_state(model, opt), saved)
        assert _train(model, opt, layout, range(1, 3)) == straight, load.__name__  # bit-identical
        _assert_same(_state(model, opt), after)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.slow
def test_save_load_resume_is_bit_identical(tmp_path, layout):
    run_on_ranks(_save_load_resume, 4, str(tmp_path), layout)


# ---- one layout's checkpoint into another -------------------------------------------------------
def _tp_checkpoint_into_other_layouts(tmp: str) -> dict[str, torch.Tensor]:
    mesh = _mesh("fsdp_tp")
    model, opt = _build("fsdp_tp", mesh)
    _train(model, opt, "fsdp_tp", range(1))
    fsdp2_ckpt.save(f"{tmp}/ckpt", model, opt, extra={"step": 1})
    saved = _state(model, opt, gather=True)
    # 1-D FSDP over all 4 ranks: the strided TP x FSDP shards are re-cut into plain row blocks.
    flat = _Llama(vocab=_TP_VOCAB, seed=1)
    flat_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in flat.layers:
        fully_shard(layer, mesh=flat_mesh)
    fully_shard(flat, mesh=flat_mesh)
    flat_opt = torch.optim.AdamW(flat.parameters(), lr=1e-2)
    _helpers_load(f"{tmp}/ckpt", flat, flat_opt)
    _assert_same(_state(flat, flat_opt, gather=True), saved)
    # torch's fully_shard on the same TP x FSDP layout, and back.
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    theirs = _Llama(vocab=_TP_VOCAB, seed=1)
    for layer in theirs.layers:
        parallelize_module(layer, mesh["tp"], _TP_PLAN)
        torch_fully_shard(layer, mesh=mesh["dp"])
    torch_fully_shard(theirs, mesh=mesh["dp"])
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    _dcp_load(f"{tmp}/ckpt", theirs, their_opt)  # fsdp2.checkpoint.save wrote plain DCP under "model"/"optim"
    _assert_same(_state(theirs, their_opt), _state(model, opt))  # same placements: same local pieces
    _dcp_save(f"{tmp}/theirs", theirs, their_opt)
    ours, our_opt = _build("fsdp_tp", mesh, seed=2)
    _dcp_load(f"{tmp}/theirs", ours, our_opt)
    _assert_same(_state(ours, our_opt), _state(model, opt))
    return _model_only(saved)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the 1-process load, on purpose
def test_fsdp_tp_checkpoint_loads_into_1d_fsdp_torch_fully_shard_and_a_plain_model(tmp_path):
    from safetensors.torch import load_file

    path = tmp_path / "ckpt"
    want = run_on_ranks(_tp_checkpoint_into_other_layouts, 4, str(tmp_path))[0]
    plain = _Llama(vocab=_TP_VOCAB, seed=1)  # this process: no process group, no sharding
    assert fsdp2_ckpt.load(path, plain) == {"step": 1}
    _assert_same(plain.state_dict(), want)
    plain = _Llama(vocab=_TP_VOCAB, seed=2)  # and through plain DCP
    sd = plain.state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(path))
    plain.load_state_dict(sd)
    _assert_same(plain.state_dict(), want)
    # What `python -m fsdp2.checkpoint export` runs: one full tensor at a time from the 2-D shards.
    export(str(path), str(tmp_path / "out.safetensors"))
    _assert_same(load_file(tmp_path / "out.safetensors"), want)


# ---- full tensors in: load_full, load_state_dict, full state dicts; full tensors out ------------
def _assert_holds(model: nn.Module, want: dict[str, torch.Tensor]) -> None:
    """Each rank holds exactly DTensor's piece of ``want`` (no padding, no other rows)."""
    for key, value in model.state_dict().items():
        assert isinstance(value, DTensor), key
        piece = distribute_tensor(want[key], value.device_mesh, value.placements, src_data_rank=None)
        torch.testing.assert_close(value.to_local(), piece.to_local(), atol=0, rtol=0, msg=key)
        torch.testing.assert_close(value.full_tensor(), want[key], atol=0, rtol=0, msg=key)


def _full_tensors_in_and_out(path: str, layout: str) -> None:
    mesh = _mesh(layout)
    want = _plain(layout).state_dict()
    source, _opt = _build(layout, mesh)
    if layout == "fsdp_tp":  # the layouts load_full must cut: strided TP x FSDP rows, TP columns
        placements = {repr(p) for v in source.state_dict().values() for p in v.placements}
        assert {"_StridedShard(dim=0, sf=2)", "Shard(dim=1)"} <= placements, placements
    fsdp2_ckpt.export_full(path, source)

    model, _opt = _build(layout, mesh, seed=1)
    model.layers[0].unshard()  # a gathered copy must not survive the load
    fsdp2_ckpt.load_full(path, model)
    _assert_holds(model, want)

    model, _opt = _build(layout, mesh, seed=1)
    model.load_state_dict(want)  # full plain tensors: each rank keeps its box
    _assert_holds(model, want)

    _assert_same(get_model_state_dict(source, options=StateDictOptions(full_state_dict=True)), want)
    model, _opt = _build(layout, mesh, seed=1)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, dict(want) if dist.get_rank() == 0 else {}, options=options)
    _assert_holds(model, want)
    if layout == "hsdp":
        # Without broadcast, torch cuts full tensors with distribute_tensor, which (torch 2.13) asserts on
        # strided shards of uneven size (w1: 19 TP rows -> 10 + 9), for torch's fully_shard too.
        model, _opt = _build(layout, mesh, seed=1)
        # A copy: torch replaces the dict's values with the DTensors it distributes them into.
        set_model_state_dict(model, dict(want), options=StateDictOptions(full_state_dict=True))
        _assert_holds(model, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_tensors_load_into_and_export_from_2d_layouts(tmp_path, layout):
    from safetensors.torch import load_file

    path = tmp_path / "model.safetensors"
    run_on_ranks(_full_tensors_in_and_out, 4, str(path), layout)
    _assert_same(load_file(path), _plain(layout).state_dict())


# ---- loading into a model built on the meta device ----------------------------------------------
def _assigned_into_meta(layout: str, how: str) -> list[float]:
    """torchtune's assign of DTensors laid out as the meta shards, or DCP's broadcast from rank 0
    (which cuts strided FSDP x TP shards too), into a model never materialized: the same values and the same
    training as a model sharded from the full weights."""
    mesh = _mesh(layout)
    full_sd, want = _plain(layout).state_dict(), _plain(layout).state_dict()  # (DCP fills rank 0's dict in place)
    with torch.device("meta"):
        model = _shard(_plain(layout), layout, mesh)
    if how == "torchtune":
        meta_sd = model.state_dict()
        sharded = {k: nn.Parameter(distribute_tensor(full_sd[k], meta_sd[k].device_mesh, meta_sd[k].placements))
                   for k in meta_sd}
        model.load_state_dict(sharded, assign=True)
    else:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full_sd if dist.get_rank() == 0 else {}, options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _assert_same(_model_only(_state(model, opt, gather=True)), want)
    ref, ref_opt = _build(layout, mesh)
    _assert_same(_state(model, opt), _state(ref, ref_opt))  # this rank's pieces too
    losses = _train(model, opt, layout, range(2))
    assert losses == _train(ref, ref_opt, layout, range(2))
    return losses


# Not torchtune's way under FSDP x TP: DTensor's distribute_tensor refuses the uneven strided shards
# (an AssertionError in torch 2.13's _StridedShard._shard_tensor), for torch's fully_shard as well.
@pytest.mark.parametrize("layout, how", [("hsdp", "torchtune"), ("hsdp", "broadcast_from_rank0"),
                                         ("fsdp_tp", "broadcast_from_rank0")])
def test_assign_loads_into_a_meta_model(layout, how):
    run_on_ranks(_assigned_into_meta, 4, layout, how)
