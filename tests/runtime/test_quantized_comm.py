"""Quantized communication (``fully_shard(..., comm_policy=QuantizedComm(...))``) and the byte counter.

Off (no policy, or ``QuantizedComm()`` with nothing quantized) must be today's fsdp2 bit for
bit, and torch's ``fully_shard``. With ``weights="int8"`` the unsharded weights are the
sharded ones quantized per block (each element within ``absmax / 254`` of its block's true
value, the same on every rank), the sharded parameters stay fp32, and the all-gather sends
the bytes ``_format.GatherFormat`` lays out, counted exactly by ``fsdp2.count_comm_bytes``.
"""

from __future__ import annotations

import functools
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp2
from fsdp2._format import HEADER, Chunking, GatherFormat, aligned
from fsdp2.comm._collectives import QuantizedReduction
from fsdp2.comm._comm import DEFAULT_REDUCE_SCATTER
from fsdp2.comm._quantize import (GradChunks, dequantize_entries, pack_values, quantize_entries, unpack_values,
                                  value_bytes)
from fsdp2.runtime._state import get_state
from tests._dist import run_on_ranks
from tests._models import MLP, Transformer, lm_loss, make_batch
from tests._parity import full

INT8 = fsdp2.QuantizedComm(weights="int8")
GRAD8 = fsdp2.QuantizedComm(gradients="int8")
BOTH8 = fsdp2.QuantizedComm(weights="int8", gradients="int8")
GRAD4 = fsdp2.QuantizedComm(gradients="int4")


# ---- the policy (no process group) --------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, match", [
    ({"weights": "int2"}, ValueError, "weights='int2' is not supported; use 'int8' or 'int4'"),
    ({"weights": 8}, TypeError, "weights must be None or a str, got 8; pass weights='int8' or 'int4'"),
    ({"gradients": "int2"}, ValueError, "gradients='int2' is not supported; use 'int8' or 'int4'"),
    ({"gradients": 8}, TypeError, "gradients must be None or a str, got 8; pass gradients='int8' or 'int4'"),
    ({"block_size": 0}, ValueError, "block_size=0 must be positive"),
    ({"block_size": 2.0}, TypeError, "block_size must be an int"),
    ({"block_size": True}, TypeError, "block_size must be an int"),
    ({"error_feedback": 1}, TypeError, "error_feedback must be a bool"),
    ({"error_feedback": True}, ValueError, "needs quantized gradients"),
])
def test_policy_rejects_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        fsdp2.QuantizedComm(**kwargs)


def test_policy_defaults_are_off():
    policy = fsdp2.QuantizedComm()
    assert (policy.weights, policy.gradients, policy.block_size, policy.error_feedback) == (None, None, 256, False)
    assert policy.weight_block == 0 and INT8.weight_block == 256
    assert policy.grad_block == INT8.grad_block == 0 and GRAD8.grad_block == 256 and GRAD8.weight_block == 0
    assert (policy.grad_bits, GRAD8.grad_bits, GRAD4.grad_bits, GRAD4.grad_block) == (0, 8, 4, 256)
    assert (policy.weight_bits, INT8.weight_bits, fsdp2.QuantizedComm(weights="int4").weight_bits) == (0, 8, 4)


# ---- the slice's layout and the quantization (no process group) ----------------------------
@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                     reason="needs CUDA")]),
])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_slice_layout_and_error_bound(device, bits):
    """Hand-computed sizes of a quantized slice; every element within half a scale of the truth
    (int8: ``absmax / 254``; int4: ``absmax / 14``)."""
    world, block = 2, 64
    shapes = [torch.Size((10, 30)), torch.Size((7,)), torch.Size((3, 5))]
    layouts = [Chunking.even(s, 0, world) for s in shapes]
    dtypes = [torch.float32, torch.float32, torch.int64]
    fmt = GatherFormat.build(layouts, dtypes, block, bits)
    # (5, 30) = 150 int8 (int4: 75 bytes) + 3 scales; (4,) = 4 int8 (2 bytes) + 1 scale; (2, 5)
    # int64 = 80 bytes, unquantized
    if bits == 8:
        expected = HEADER + aligned(150) + aligned(12) + aligned(4) + aligned(4) + aligned(80)
        assert fmt.slice_bytes == expected == 16 + 160 + 16 + 16 + 16 + 80
    else:
        expected = HEADER + aligned(75) + aligned(12) + aligned(2) + aligned(4) + aligned(80)
        assert fmt.slice_bytes == expected == 16 + 80 + 16 + 16 + 16 + 80
    raw = GatherFormat.build(layouts, dtypes)
    assert raw.slice_bytes == HEADER + aligned(600) + aligned(16) + aligned(80)

    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(10, 30, generator=g) * torch.logspace(-3, 1, 30), torch.zeros(7),
             torch.randint(-9, 9, (3, 5), generator=g)]
    fulls = [t.to(device) for t in fulls]
    output = torch.empty(world * fmt.slice_bytes, dtype=torch.uint8, device=device)
    for rank in range(world):
        entries = [lay.chunks_view(torch.cat([t, t.new_zeros((lay.padded_shape[0] - t.shape[0], *t.shape[1:]))]))[rank]
                   for lay, t in zip(layouts, fulls)]
        quantize_entries(fmt, entries, output[rank * fmt.slice_bytes:(rank + 1) * fmt.slice_bytes])
    outs = [torch.empty(lay.padded_shape, dtype=dt, device=device) for lay, dt in zip(layouts, dtypes)]
    dequantize_entries(fmt, output, [lay.chunks_view(o) for lay, o in zip(layouts, outs)])
    got, want = outs[0][:10], fulls[0]
    for rank in range(world):  # per block of each rank's flattened chunk
        chunk_got, chunk_want = got[rank * 5:(rank + 1) * 5].flatten(), want[rank * 5:(rank + 1) * 5].flatten()
        for start in range(0, 150, block):
            w, q = chunk_want[start:start + block], chunk_got[start:start + block]
            assert (q - w).abs().max() <= w.abs().max() / (254 if bits == 8 else 14) * (1 + 1e-6)
    assert not torch.equal(got, want)  # it did quantize
    assert torch.equal(outs[1][:7], fulls[1])  # an all-zero block comes back as zeros
    assert torch.equal(outs[2][:3], fulls[2])  # integers travel as they are


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                     reason="needs CUDA")]),
])
@pytest.mark.parametrize("bits", [8, 4])
def test_gradient_chunks_layout_and_sum(device, bits):
    """``GradChunks`` by hand: 3 ranks' rows of 70 elements in blocks of 32 pack as 80 bytes of
    int8 (70, aligned; int4: 35 bytes, 48 aligned) and 3 scales; the dequantized sum is within
    the ranks' half-scales (``absmax / 254``; int4 ``absmax / 14``), and one rank alone comes
    close to that bound."""
    world, numel, block = 3, 70, 32
    half_step = 254 if bits == 8 else 14
    chunks = GradChunks(world, numel, block, bits)
    assert (chunks.blocks, chunks.values_bytes, chunks.chunk_bytes) == ((3, 80, 92) if bits == 8 else (3, 48, 60))
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(world, numel, generator=g).to(device) * 10 ** r for r in range(world)]
    sources[0][:, :32] = 0  # an all-zero block travels as zeros
    packed = [torch.empty(world * chunks.chunk_bytes, dtype=torch.uint8, device=device) for _ in sources]
    errors = [torch.empty(world, numel, device=device) for _ in sources]
    for src, buf, err in zip(sources, packed, errors):
        chunks.quantize(src, buf, err)

    def bound(row: torch.Tensor) -> torch.Tensor:
        return F.pad(row, (0, 26)).view(-1, block).abs().amax(1).repeat_interleave(block)[:numel] / half_step

    worst = 0.0
    for dest in range(world):  # what rank ``dest`` receives: row ``dest`` of every source
        received = torch.stack([buf.view(world, -1)[dest] for buf in packed])
        got = chunks.dequantize_sum(received, torch.float32)
        want = sum(src[dest] for src in sources)
        assert torch.allclose(got, want - sum(err[dest] for err in errors), rtol=1e-6, atol=1e-5)
        assert ((got - want).abs() <= sum(bound(src[dest]) for src in sources) * (1 + 1e-5) + 1e-6).all()
        for src in sources:  # one rank alone: the bound is reached closely
            one = GradChunks(1, numel, block, bits)
            buf = torch.empty(one.chunk_bytes, dtype=torch.uint8, device=device)
            one.quantize(src[dest:dest + 1], buf)
            e1 = (one.dequantize_sum(buf, torch.float32) - src[dest]).abs()
            assert (e1 <= bound(src[dest]) * (1 + 1e-5) + 1e-6).all()
            worst = max(worst, (e1 / (bound(src[dest]) + 1e-30)).max().item())
    assert 0.8 < worst <= 1.0 + 1e-5
    values, scales = chunks.views(packed[0])
    assert scales[:, 0].eq(0).all()
    if bits == 8:
        assert values.dtype == torch.int8 and values.abs().max() == 127
    else:
        assert values.dtype == torch.uint8 and values.shape == (world, 35)
        q = unpack_values(values, numel, 4)
        assert q.abs().max() == 7 and q[:, :32].eq(0).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_large_groups_are_quantized_a_range_at_a_time_with_the_same_bytes(monkeypatch, bits):
    """Above ``SLICE_ELEMENTS`` the quantization, the dequantization and the sum run a range
    of whole blocks at a time: the same bytes, errors, sums and weights as one pass, and
    temporaries of a range's size instead of several times the whole (here 13 ranges)."""
    from fsdp2.comm import _quantize
    from fsdp2.memory._live import LiveStorages

    world, numel, block = 8, 64 * 50 + 7, 64
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(world, numel, generator=g) * 10
    layouts = [Chunking.even(torch.Size([world * 50, 64 + 3]), 0, world), Chunking.even(torch.Size([9]), 0, world)]
    fmt = GatherFormat.build(layouts, [torch.float32] * 2, block, bits)
    shards = [[torch.randn(lay.local_shape, generator=g) for lay in layouts] for _ in range(world)]

    def run() -> tuple[list[torch.Tensor], int]:
        chunks = GradChunks(world, numel, block, bits)
        packed = torch.zeros(world * chunks.chunk_bytes, dtype=torch.uint8)
        error = torch.empty(world, numel)
        live = LiveStorages()
        for t in (rows, packed, error):
            live.add(t)
        held = live.total
        with live:
            chunks.quantize(rows, packed, error)
        peak = live.peak - held
        summed = chunks.dequantize_sum(packed, torch.float32)
        # error feedback's path: bf16 gradients, two residuals across the ranges' edges
        reduction = QuantizedReduction(chunks, (0, 700), dist.ReduceOp.SUM, None, 1.0, torch.float32)
        residuals = [torch.ones(world, 700) * 0.3, torch.ones(world, numel - 700) * -0.2]
        fed = torch.zeros_like(packed)
        reduction.quantize(rows.bfloat16(), fed, residuals)
        gathered = torch.zeros(world * fmt.slice_bytes, dtype=torch.uint8)
        for r in range(world):
            quantize_entries(fmt, shards[r], gathered[r * fmt.slice_bytes:(r + 1) * fmt.slice_bytes])
        weights = [torch.empty(world, *lay.local_shape) for lay in layouts]
        dequantize_entries(fmt, gathered, weights)
        return [packed, error, summed, gathered, *weights, fed, *residuals], peak

    whole, peak_whole = run()
    monkeypatch.setattr(_quantize, "SLICE_ELEMENTS", world * 64 * 4)  # 4 blocks a row a range
    assert len(_quantize.block_slices(world, numel, block, bits)) == 13
    ranged, peak_ranged = run()
    for a, b in zip(whole, ranged):
        assert torch.equal(a, b)
    assert peak_whole >= 3 * rows.nbytes  # one pass: a few fp32 copies of everything at once
    assert peak_ranged <= 5 * world * 4 * 64 * 4  # a range's fp32 size (4 blocks a row), a few times


@pytest.mark.parametrize("bits", [8, 4])
def test_hsdp_quantized_all_reduce_runs_a_range_at_a_time(monkeypatch, bits):
    """HSDP's quantized all-reduce quantizes and dequantizes ``out`` a range of whole blocks at a
    time: the same result as one pass, with fp32 temporaries of a range's size instead of
    several copies of ``out`` (collectives standing in for 4 replicas: any bytes in, the same
    bytes handled by both)."""
    from fsdp2.comm import _quantize
    from fsdp2.comm._collectives import quantized_all_reduce
    from fsdp2.memory._live import LiveStorages

    replicas = 4
    x = torch.randn(64 * 400 + 5, generator=torch.Generator().manual_seed(0)) * 3

    def all_to_all(recv: torch.Tensor, send: torch.Tensor) -> None:
        recv.view(replicas, -1).copy_(send.view(replicas, -1).roll(1, 0))

    def run() -> tuple[torch.Tensor, int]:
        out = x.clone()
        live = LiveStorages()
        live.add(out)
        held = live.total
        with live:
            quantized_all_reduce(out, replicas, 64, bits, True, all_to_all,
                                 lambda gathered, packed: gathered.copy_(packed.repeat(replicas)))
        return out, live.peak - held

    whole, peak_whole = run()
    monkeypatch.setattr(_quantize, "SLICE_ELEMENTS", replicas * 64 * 4)  # 4 blocks of each chunk a range
    assert len(_quantize.block_slices(replicas, -(-x.numel() // replicas), 64, bits)) == 26
    ranged, peak_ranged = run()
    assert torch.equal(whole, ranged) and not torch.equal(ranged, x)
    assert peak_whole >= 3 * x.nbytes  # one pass: fp32 copies of all of out at once
    assert peak_ranged < x.nbytes  # the quantized buffers and one chunk's sum, the ranges' few KiB


def test_int4_packing_is_low_nibble_first():
    """Two values a byte, element ``2i`` in byte ``i``'s low nibble, two's complement; an odd
    count leaves the last high nibble zero; unpacking sign-extends."""
    q = torch.tensor([[1, -1, 7, -7, 3], [0, 0, -1, 2, -5]])
    packed = pack_values(q, 4)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0xF1, 0x97, 0x03], [0x00, 0x2F, 0x0B]]
    assert torch.equal(unpack_values(packed, 5, 4), q.to(torch.int8))
    every = torch.arange(-7, 8).repeat(2, 1)
    assert torch.equal(unpack_values(pack_values(every, 4), 15, 4), every.to(torch.int8))
    assert value_bytes(5, 4) == 3 and value_bytes(5, 8) == 5


# ---- off: bit for bit --------------------------------------------------------------------------
def _train_transformer(impl: str, steps: int, comm_policy=None, mp_policy=None, lr: float = 1e-2,
                       one_batch: bool = False, device: str = "cpu", keep_params: bool = True) -> dict:
    """Train the test Transformer ``steps`` AdamW steps (``one_batch``: on the same batch each
    step, so the loss must fall); losses, full parameters after each step (``keep_params``:
    ``full_tensor()`` on CUDA tensors over gloo crashed the process on the H200), bytes sent."""
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    model = Transformer(n_layers=2).to(device)
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    if impl == "torch":
        shard = torch_fully_shard
    else:
        def shard(m, **kw):
            return fsdp2.fully_shard(m, comm_policy=comm_policy, **kw)
    for block in model.layers:
        shard(block, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, params = [], []
    with fsdp2.count_comm_bytes() as sent:
        for step in range(steps):
            inputs, targets = make_batch(dist.get_rank(), 0 if one_batch else step, device=device)
            loss = lm_loss(model(inputs), targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            with torch.no_grad():
                if keep_params:
                    params.append({n: full(p).clone() for n, p in model.named_parameters()})
    sharded_dtypes = {str(p.dtype) for p in model.parameters()}
    return {"losses": losses, "params": params, "sent": (sent.all_gather, sent.reduce_scatter, sent.all_reduce),
            "dtypes": sharded_dtypes}


@functools.cache
def _unquantized(steps: int, *, one_batch: bool = False, bf16: bool = False) -> dict:
    """The unquantized run several tests compare against (fp32 on one batch, or under bf16
    mixed precision), trained once per pool of ranks: the pool's ranks run every task together,
    so each has it or none; it is deterministic, and its callers only read it."""
    mp_policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 \
        else None
    return _train_transformer("fsdp2", steps, mp_policy=mp_policy, one_batch=one_batch)


def _off_is_today() -> None:
    today = _train_transformer("fsdp2", 3)
    off = _train_transformer("fsdp2", 3, comm_policy=fsdp2.QuantizedComm())
    torch_ = _train_transformer("torch", 3)
    assert today["losses"] == off["losses"] == torch_["losses"]
    for a, b, c in zip(today["params"], off["params"], torch_["params"]):
        for name in a:
            assert torch.equal(a[name], b[name]) and torch.equal(a[name], c[name]), name
    assert today["sent"] == off["sent"]


def test_off_is_bit_identical_to_today_and_torch():
    run_on_ranks(_off_is_today, 2)


def _cuda_against_cpu(policy: fsdp2.QuantizedComm) -> dict:
    torch.cuda.set_device(0)  # both ranks on one GPU: gloo moves CUDA tensors, NCCL would refuse
    runs = {(dev, name): _train_transformer("fsdp2", 6, comm_policy=pol, one_batch=True, device=dev,
                                             keep_params=False)["losses"]
            for dev in ("cpu", "cuda") for name, pol in (("off", None), ("on", policy))}
    torch.cuda.synchronize()
    return runs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", [
    BOTH8, fsdp2.QuantizedComm(weights="int4", gradients="int4", block_size=64, error_feedback=True)],
    ids=["int8", "int4-ef-block64"])
def test_quantized_training_on_cuda_tensors_matches_cpu(policy):
    """The quantized all-gather and all-to-all on CUDA tensors, with real collectives: two ranks
    share the one GPU a GPU machine has, over gloo. Six steps' losses agree with the same
    training on CPU to 1e-4 relative and to a quarter of what quantizing changes (rounding order
    only; the first run, on one H200 on 2026-11-26, agreed to <= 1.1e-5 where int8 changed the
    losses by ~4.6e-5): quantization that did nothing on CUDA would fail."""
    runs = run_on_ranks(_cuda_against_cpu, 2, policy)[0]

    def rel(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) / abs(x) for x, y in zip(a, b))

    effect = rel(runs["cuda", "off"], runs["cuda", "on"])
    assert effect > 0 and rel(runs["cpu", "off"], runs["cpu", "on"]) > 0
    for name in ("off", "on"):
        cpu, cuda = runs["cpu", name], runs["cuda", name]
        assert rel(cpu, cuda) <= min(1e-4, effect / 4), (name, cpu, cuda, effect)
    assert runs["cuda", "on"][-1] < runs["cuda", "on"][0] / 1.5


# ---- weights int8 ------------------------------------------------------------------------------
def _unsharded_within_bound(block: int, weights: str = "int8") -> dict:
    """The weights forward sees: each within half a scale of the sharded truth, the same on every rank."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = MLP(40, 50)  # (50, 40) and (40, 50): chunks that are not whole blocks; biases of 50 and 40
    torch.manual_seed(1)
    for p in model.parameters():
        nn.init.normal_(p)
    fsdp2.fully_shard(model, mesh=mesh, comm_policy=fsdp2.QuantizedComm(weights=weights, block_size=block))
    group = get_state(model).group
    assert group.gather_transport.name == "flat"
    truth = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    model.unshard()
    seen = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.reshard()
    world = dist.get_world_size()
    worst = 0.0
    for name, want in truth.items():
        got = seen[name]
        assert got.dtype == torch.float32 and got.shape == want.shape
        lay = Chunking.even(want.shape, 0, world)
        padded = torch.cat([want, want.new_zeros((lay.padded_shape[0] - want.shape[0], *want.shape[1:]))])
        chunks_want = lay.chunks_view(padded).reshape(world, -1)
        got_padded = torch.cat([got, got.new_zeros(padded.shape[0] - got.shape[0], *got.shape[1:])])
        chunks_got = lay.chunks_view(got_padded).reshape(world, -1)
        for r in range(world):
            for start in range(0, chunks_want.shape[1], block):
                w, q = chunks_want[r, start:start + block], chunks_got[r, start:start + block]
                bound = w.abs().max().item() / (254 if weights == "int8" else 14)
                err = (q - w).abs().max().item()
                assert err <= bound * (1 + 1e-6), (name, r, start, err, bound)
                worst = max(worst, err / bound if bound else 0.0)
        assert not torch.equal(got, want), name
    checksum = torch.stack([t.double().sum() for t in seen.values()])
    gathered = [torch.empty_like(checksum) for _ in range(world)]
    dist.all_gather(gathered, checksum)
    assert all(torch.equal(g, gathered[0]) for g in gathered)  # every rank computes with the same weights
    for p in model.parameters():  # the sharded parameters stay full precision
        assert p.dtype == torch.float32
    return {"worst": worst}


@pytest.mark.parametrize("world, weights", [(2, "int8"), (4, "int8"), (2, "int4"), (4, "int4")])
def test_unsharded_weights_within_half_a_scale(world, weights):
    results = run_on_ranks(_unsharded_within_bound, world, 32, weights)
    assert 0.5 < results[0]["worst"] <= 1.0  # the bound is reached closely: it is the right one


def _train_int8_against_fp32(steps: int) -> dict:
    ref = _unquantized(steps, one_batch=True)
    quant = _train_transformer("fsdp2", steps, comm_policy=INT8, one_batch=True)
    diffs, rms = [], []
    for a, b in zip(ref["params"], quant["params"]):
        delta = torch.cat([(a[n] - b[n]).flatten() for n in a])
        diffs.append(delta.abs().max().item())
        rms.append(delta.pow(2).mean().sqrt().item())
    return {"ref": ref["losses"], "quant": quant["losses"], "diffs": diffs, "rms": rms, "dtypes": quant["dtypes"],
            "sent": (ref["sent"], quant["sent"])}


def test_int8_weights_train_close_to_unquantized():
    """The bound, per step ``k``: an AdamW step (lr 1e-2) moves each element by about ``lr``
    whatever its gradient's scale (exactly ``lr`` at the first step), so quantized weights can
    change an element by at most ``2 * lr`` per step, by flipping its update's sign (the max
    bound, reached at step 1 by elements with near-zero gradients). Over all elements they do
    far less: the RMS difference stays under a fifth of one update per step (measured:
    0.05-0.16 of it; the max reaches its bound at step 2). Losses within 1% (measured 0.2%), and
    falling (one batch, learned)."""
    steps, lr = 8, 1e-2
    result = run_on_ranks(_train_int8_against_fp32, 2, steps)[0]
    for k, (diff, rms) in enumerate(zip(result["diffs"], result["rms"]), start=1):
        assert diff <= 2 * k * lr * (1 + 1e-4), (k, result["diffs"])
        assert rms <= 0.2 * k * lr, (k, result["rms"])
    for ref, quant in zip(result["ref"], result["quant"]):
        assert abs(quant - ref) <= 0.01 * ref, (result["ref"], result["quant"])
    assert result["quant"][-1] < 0.8 * result["quant"][0]  # it learns
    assert result["dtypes"] == {"torch.float32"}  # the sharded parameters (and so AdamW's state) stay fp32
    (ref_ag, ref_rs, _), (q_ag, q_rs, _) = result["sent"]
    assert q_rs == ref_rs  # gradients are reduced as before
    assert 0.25 < q_ag / ref_ag < 0.30  # int8 values and fp32 scales against fp32


def _bf16_int8_bytes() -> dict:
    bf16 = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    base = _unquantized(2, bf16=True)
    quant = _train_transformer("fsdp2", 2, comm_policy=INT8, mp_policy=bf16)
    return {"base": base["sent"], "quant": quant["sent"], "losses": (base["losses"], quant["losses"])}


def test_int8_weights_with_bf16_mixed_precision():
    result = run_on_ranks(_bf16_int8_bytes, 2)[0]
    (b_ag, b_rs, _), (q_ag, q_rs, _) = result["base"], result["quant"]
    assert q_rs == b_rs
    assert 0.5 < q_ag / b_ag < 0.6  # int8 + scales against bf16 (headers and alignment included)
    base, quant = result["losses"]
    assert abs(quant[-1] - base[-1]) <= 0.02 * base[-1]


# ---- the byte counter, exactly ---------------------------------------------------------------
def _counted(comm_policy, hsdp: bool) -> dict:
    world = dist.get_world_size()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    model = MLP(24, 40)
    fsdp2.fully_shard(model, mesh=mesh, reshard_after_forward=True, comm_policy=comm_policy)
    x = torch.randn(3, 24)
    with fsdp2.count_comm_bytes() as sent, fsdp2.count_comm_bytes() as again:
        model(x).sum().backward()
    assert (again.all_gather, again.reduce_scatter, again.all_reduce) == (sent.all_gather, sent.reduce_scatter,
                                                                          sent.all_reduce)
    return {"bytes": (sent.all_gather, sent.reduce_scatter, sent.all_reduce), "calls": dict(sent.calls),
            "total": sent.total}


def _expected(world: int, shard: int, replicas: int, block: int, grad_block: int = 0,
              grad_bits: int = 8, weight_bits: int = 8) -> tuple[int, int, int]:
    """By hand: MLP(24, 40) is in_proj (40, 24) + (40,), out_proj (24, 40) + (24,), fp32. With
    ``grad_block`` the reduce-scatter is an all-to-all of each rank's chunk packed as int8 values
    (16-byte aligned; ``grad_bits=4``: two values a byte, rounded up) and one fp32 scale per
    block, counted under ``reduce_scatter``."""
    shapes = [(40, 24), (40,), (24, 40), (24,)]
    rows = [-(-s[0] // shard) for s in shapes]
    numels = [r * (s[1] if len(s) > 1 else 1) for r, s in zip(rows, shapes)]
    if block:
        slice_bytes = HEADER + sum(aligned(n if weight_bits == 8 else -(-n // 2)) + aligned(4 * -(-n // block))
                                   for n in numels)
    else:
        slice_bytes = HEADER + sum(aligned(4 * n) for n in numels)
    all_gather = 2 * (shard - 1) * slice_bytes  # forward and backward
    reduce_scatter = (shard - 1) * 4 * sum(numels)
    if grad_block:
        value_bytes = sum(numels) if grad_bits == 8 else -(-sum(numels) // 2)
        reduce_scatter = (shard - 1) * (aligned(value_bytes) + 4 * -(-sum(numels) // grad_block))
    all_reduce = 2 * (replicas - 1) * -(-sum(numels) // replicas) * 4 if replicas > 1 else 0
    return all_gather, reduce_scatter, all_reduce


@pytest.mark.parametrize("world, hsdp", [(2, False), (4, True)])
def test_bytes_counted_exactly(world, hsdp):
    shard, replicas = (world // 2, 2) if hsdp else (world, 1)
    for policy, block, grad_block in ((None, 0, 0), (INT8, 256, 0),
                                      (fsdp2.QuantizedComm(weights="int8", block_size=16), 16, 0),
                                      (GRAD8, 0, 256), (GRAD4, 0, 256),
                                      (fsdp2.QuantizedComm(weights="int8", gradients="int8", block_size=16), 16, 16),
                                      (fsdp2.QuantizedComm(weights="int8", gradients="int4", block_size=16), 16, 16),
                                      (fsdp2.QuantizedComm(weights="int4"), 256, 0),
                                      (fsdp2.QuantizedComm(weights="int4", gradients="int4", block_size=16), 16, 16)):
        result = run_on_ranks(_counted, world, policy, hsdp)
        assert all(r == result[0] for r in result)
        bits = (policy.grad_bits, policy.weight_bits or 8) if policy is not None else (0, 8)
        assert result[0]["bytes"] == _expected(world, shard, replicas, block, grad_block, *bits), (policy, result[0])
        assert result[0]["calls"] == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1 if hsdp else 0}
        assert result[0]["total"] == sum(result[0]["bytes"])


# ---- transports and unsupported combinations -----------------------------------------------------
def _exchange_group_quantized(which: str) -> dict:
    """Two MLPs on the CPU exchange, one with ``QuantizedComm`` for ``which`` ("weights" or
    "gradients"): the transports each group took, and how far the quantized one's output and
    gradients are from the plain one's (for gradients also: a custom reduce-scatter refused)."""
    os.environ["FSDP2_CPU_COLLECTIVES"] = "exchange"
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        plain, quant = MLP(16), MLP(16)
        quant.load_state_dict(plain.state_dict())
        fsdp2.fully_shard(plain, mesh=mesh)
        fsdp2.fully_shard(quant, mesh=mesh, comm_policy=INT8 if which == "weights" else GRAD8)
        names = [(get_state(m).group.gather_transport.name, get_state(m).group.reduce_transport.name)
                 for m in (plain, quant)]
        x = torch.randn(4, 16)
        outs = [m(x) for m in (plain, quant)]
        for out in outs:
            out.sum().backward()
        grads = [full(m.in_proj.weight.grad) for m in (plain, quant)]
        result = {"names": names, "out_diff": (outs[0] - outs[1]).abs().max().item(),
                  "grad_diff": (grads[0] - grads[1]).abs().max().item(),
                  "transport": repr(get_state(quant).group.reduce_transport)}
        if which == "gradients":
            try:
                quant.set_custom_reduce_scatter(DEFAULT_REDUCE_SCATTER)
                result["refused"] = ""
            except ValueError as e:
                result["refused"] = str(e)
        return result
    finally:
        del os.environ["FSDP2_CPU_COLLECTIVES"]


def test_exchange_transport_groups_keep_the_exchange_when_weights_quantized():
    # tests/comm/test_exchange_quantized.py: the exchange's quantized training equals the flat transport's
    result = run_on_ranks(_exchange_group_quantized, 2, "weights")[0]
    assert result["names"][0] == ("exchange", "exchange")  # as asked
    assert result["names"][1] == result["names"][0]
    assert 0 < result["out_diff"] < 0.05 and result["grad_diff"] < 0.05


def _refused(case: str) -> str:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = MLP(8)
    before = {n: p for n, p in model.named_parameters()}
    kwargs: dict = {"mesh": mesh}
    if case == "int_reshard":
        kwargs.update(comm_policy=INT8, reshard_after_forward=2)
    elif case == "type":
        kwargs.update(comm_policy={"weights": "int8"})
    elif case == "extension":
        from tests._int8 import Int8Rows
        model.in_proj.weight = nn.Parameter(Int8Rows.from_float(model.in_proj.weight.detach()))
        before = {n: p for n, p in model.named_parameters()}
        kwargs.update(comm_policy=INT8)
    try:
        fsdp2.fully_shard(model, **kwargs)
    except (TypeError, ValueError) as e:
        after = {n: p for n, p in model.named_parameters()}
        assert not isinstance(model, fsdp2.FSDPModule)
        assert all(after[n] is p for n, p in before.items())  # untouched
        return f"{type(e).__name__}: {e}"
    return "accepted"


@pytest.mark.parametrize("case, match", [
    # on 4 ranks: 2 keeps half the parameters (on 2 it means True, which is supported)
    ("int_reshard", r"ValueError: .*reshard_after_forward=2 \(int\) is not supported with "
                    r"comm_policy=QuantizedComm\(weights='int8'\)"),
    ("type", r"TypeError: fully_shard: comm_policy must be None or an fsdp2.QuantizedComm, got dict"),
    ("extension", r"ValueError: .*'in_proj.weight' \(Int8Rows\) gathers its own data"),
])
def test_unsupported_combinations_leave_the_module(case, match):
    message = run_on_ranks(_refused, 4 if case == "int_reshard" else 2, case)[0]
    assert re.search(match, message), message


# ---- gradients int8 ---------------------------------------------------------------------------
def _packed_rows(grads: list[torch.Tensor], world: int) -> torch.Tensor:
    """The rank-major rows a quantized reduce-scatter quantizes: row ``r`` is chunk ``r`` (dim 0,
    zero-padded) of every gradient, flattened, back to back (``(world, total)``)."""
    rows = []
    for g in grads:
        lay = Chunking.even(g.shape, 0, world)
        padded = torch.cat([g, g.new_zeros((lay.padded_shape[0] - g.shape[0], *g.shape[1:]))])
        rows.append(lay.chunks_view(padded).reshape(world, -1))
    return torch.cat(rows, dim=1)


def _reduced_within_bound(block: int, hsdp: bool, gradients: str = "int8") -> dict:
    """The reduced gradient against the exact average of the ranks' gradients: each rank's
    quantization error is at most ``absmax / 254`` per element (its block's largest magnitude;
    int4: ``absmax / 14``), so the average is off by at most the sum of those over the ranks,
    divided by the world."""
    half_steps = 254 if gradients == "int8" else 14
    world = dist.get_world_size()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    shard = world // 2 if hsdp else world
    torch.manual_seed(3)
    plain = MLP(40, 50)
    model = MLP(40, 50)
    model.load_state_dict(plain.state_dict())
    fsdp2.fully_shard(model, mesh=mesh, comm_policy=fsdp2.QuantizedComm(gradients=gradients, block_size=block))
    assert get_state(model).group.reduce_transport.name == "flat"
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    x = torch.randn(6, 40, generator=g) * (1 + dist.get_rank())
    plain(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    names = [n for n, _ in plain.named_parameters()]
    local = torch.cat([p.grad.flatten() for p in plain.parameters()])
    every = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(every, local)  # every rank's own (unreduced) gradient
    shapes = [p.shape for p in plain.parameters()]

    def split(flat: torch.Tensor) -> list[torch.Tensor]:
        return [t.view(s) for t, s in zip(flat.split([s.numel() for s in shapes]), shapes)]

    exact = [t / world for t in split(sum(every))]
    got = [full(p.grad) for p in model.parameters()]
    # The bound per element: each source rank's row for the shard rank that reduces it, by block.
    bound = torch.zeros(shard, _packed_rows(exact, shard).shape[1])
    for src in every:
        rows = _packed_rows(split(src), shard)
        n = rows.shape[1]
        blocked = torch.nn.functional.pad(rows, (0, -(-n // block) * block - n)).view(shard, -1, block)
        bound += (blocked.abs().amax(dim=2, keepdim=True) / half_steps).expand_as(blocked).reshape(shard, -1)[:, :n]
    bound /= world
    err = (_packed_rows(got, shard) - _packed_rows(exact, shard)).abs()
    slack = 1e-5 * _packed_rows(exact, shard).abs() + 1e-7
    assert (err <= bound + slack).all(), (err - bound).max().item()
    for name, a, b in zip(names, got, exact):
        assert not torch.equal(a, b), name
    return {"worst": (err / (bound + 1e-12)).max().item(), "rel": max(
        ((a - b).norm() / b.norm()).item() for a, b in zip(got, exact))}


@pytest.mark.parametrize("world, hsdp", [(2, False), (4, False), (4, True)])
def test_reduced_gradients_within_the_quantization_bound(world, hsdp):
    results = run_on_ranks(_reduced_within_bound, world, 32, hsdp)
    assert all(r["worst"] <= 1.0 + 1e-3 for r in results)
    assert max(r["rel"] for r in results) < 0.02  # relative error of each gradient (measured ~0.3%)


@pytest.mark.parametrize("world, hsdp", [(2, False), (4, True)])
def test_int4_reduced_gradients_within_the_quantization_bound(world, hsdp):
    results = run_on_ranks(_reduced_within_bound, world, 32, hsdp, "int4")
    assert all(0.5 < r["worst"] <= 1.0 + 1e-3 for r in results)  # the bound, reached closely
    assert max(r["rel"] for r in results) < 0.2  # relative error of each gradient (measured 9.5-10.6%)


def _train_quantized_grads(steps: int) -> dict:
    ref = _unquantized(steps, one_batch=True)
    out = {"ref": ref["losses"]}
    for key, policy in (("grads", GRAD8), ("both", BOTH8)):
        quant = _train_transformer("fsdp2", steps, comm_policy=policy, one_batch=True)
        diffs, rms = [], []
        for a, b in zip(ref["params"], quant["params"]):
            delta = torch.cat([(a[n] - b[n]).flatten() for n in a])
            diffs.append(delta.abs().max().item())
            rms.append(delta.pow(2).mean().sqrt().item())
        out[key] = {"losses": quant["losses"], "diffs": diffs, "rms": rms, "dtypes": quant["dtypes"],
                    "sent": quant["sent"]}
    out["ref_sent"] = ref["sent"]
    return out


def test_int8_gradients_train_close_to_unquantized():
    """As for int8 weights: AdamW (lr 1e-2) moves an element by about ``lr`` a step whatever its
    gradient's scale, so a quantized gradient can change an element by at most ``2 * lr`` per
    step (a flipped update; measured max 0.046 after 8 steps with int8 gradients, 0.135 with
    weights too); over all elements the RMS difference stays a small part of one update per
    step (measured 0.03-0.17 of it). Losses within 1% (measured 0.05% and 0.1%), falling, for
    gradients alone and with the weights."""
    steps, lr = 8, 1e-2
    result = run_on_ranks(_train_quantized_grads, 2, steps)[0]
    for key in ("grads", "both"):
        r = result[key]
        for k, (diff, rms) in enumerate(zip(r["diffs"], r["rms"]), start=1):
            # 1%: after step 1 an Adam update can exceed lr slightly (measured 0.06% over at step 2)
            assert diff <= 2 * k * lr * 1.01, (key, k, r["diffs"])
            assert rms <= 0.2 * k * lr, (key, k, r["rms"])
        for ref, quant in zip(result["ref"], r["losses"]):
            assert abs(quant - ref) <= 0.01 * ref, (key, result["ref"], r["losses"])
        assert r["losses"][-1] < 0.8 * r["losses"][0]
        assert r["dtypes"] == {"torch.float32"}
    (ref_ag, ref_rs, _), (g_ag, g_rs, _) = result["ref_sent"], result["grads"]["sent"]
    assert g_ag == ref_ag  # weights gathered as before
    assert 0.25 < g_rs / ref_rs < 0.27  # int8 values and fp32 scales against fp32


def _bf16_both_bytes(block: int) -> dict:
    bf16 = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    base = _unquantized(2, bf16=True)
    policy = fsdp2.QuantizedComm(weights="int8", gradients="int8", block_size=block)
    quant = _train_transformer("fsdp2", 2, comm_policy=policy, mp_policy=bf16)
    return {"base": base["sent"], "quant": quant["sent"], "losses": (base["losses"], quant["losses"])}


@pytest.mark.parametrize("block, low, high", [(256, 0.5, 0.56), (4096, 0.5, 0.53)])
def test_int8_weights_and_gradients_against_bf16_bytes(block, low, high):
    """Both collectives int8 against ``MixedPrecisionPolicy(bf16, bf16)``: a little over half of
    bf16's bytes per step (int8 is half of bf16; the scales, headers and alignment add the
    rest), whatever the block size: the issue's 0.30x is out of reach of int8 values."""
    result = run_on_ranks(_bf16_both_bytes, 2, block)[0]
    (b_ag, b_rs, _), (q_ag, q_rs, _) = result["base"], result["quant"]
    assert low < (q_ag + q_rs) / (b_ag + b_rs) < high, (result["base"], result["quant"])
    assert 0.5 < q_rs / b_rs < high
    base, quant = result["losses"]
    assert abs(quant[-1] - base[-1]) <= 0.02 * base[-1]


def test_exchange_transport_groups_keep_the_exchange_when_gradients_quantized():
    result = run_on_ranks(_exchange_group_quantized, 2, "gradients")[0]
    assert result["names"][0] == ("exchange", "exchange")
    assert result["names"][1] == result["names"][0]
    assert 0 < result["grad_diff"] < 0.05
    assert "cannot run" in result["refused"]
    assert result["transport"] == "ExchangeTransport(may_read=False, must_read=False, grad_block=256)"


def _summed_over_steps(steps: int) -> dict:
    """The same gradients reduced ``steps`` times (no optimizer step): without error feedback
    each reduction makes the same error, so the sum is off by ``steps`` times it; with it
    the sum telescopes (``steps * g - residual``), off by one reduction's error at most."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(5)
    plain = MLP(40, 50)
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(20 + dist.get_rank()))
    plain(x).pow(2).sum().backward()
    exact = [p.grad.clone() for p in plain.parameters()]
    for g in exact:
        dist.all_reduce(g)
        g /= world
    out = {}
    for feedback in (False, True):
        model = MLP(40, 50)
        model.load_state_dict(plain.state_dict())
        policy = fsdp2.QuantizedComm(gradients="int8", block_size=32, error_feedback=feedback)
        fsdp2.fully_shard(model, mesh=mesh, comm_policy=policy)
        sums = [torch.zeros_like(g) for g in exact]
        first = None
        for _ in range(steps):
            model(x).pow(2).sum().backward()
            grads = [full(p.grad) for p in model.parameters()]
            first = first or max((g - e).abs().max().item() for g, e in zip(grads, exact))
            for s, g in zip(sums, grads):
                s += g
            model.zero_grad()
        params = get_state(model).group.params
        out[feedback] = {"first": first, "sum_err": max((s - steps * e).abs().max().item()
                                                        for s, e in zip(sums, exact)),
                         "residuals": [None if p.grad_residual is None else tuple(p.grad_residual.shape)
                                       for p in params],
                         "shapes": [(world, p.layout.local_numel) for p in params]}
    return out


def test_error_feedback_keeps_the_error_from_accumulating():
    steps = 8
    result = run_on_ranks(_summed_over_steps, 2, steps)[0]
    off, on = result[False], result[True]
    assert off["first"] == on["first"]  # the first step has no residual yet
    assert off["sum_err"] > 0.9 * steps * off["first"]  # the same error every step
    assert on["sum_err"] <= 2 * on["first"]  # telescoped: about one step's error
    assert off["residuals"] == [None] * 4 and on["residuals"] == on["shapes"]  # fp32, full padded size


# ---- int4 gradients --------------------------------------------------------------------------
def _train_int4_grads(steps: int) -> dict:
    ref = _unquantized(steps, one_batch=True)
    out = {"ref": ref["losses"], "ref_sent": ref["sent"]}
    for key, policy in (("grads", GRAD4), ("both", fsdp2.QuantizedComm(weights="int8", gradients="int4")),
                        ("both4", fsdp2.QuantizedComm(weights="int4", gradients="int4"))):
        quant = _train_transformer("fsdp2", steps, comm_policy=policy, one_batch=True)
        out[key] = {"losses": quant["losses"], "dtypes": quant["dtypes"], "sent": quant["sent"]}
    return out


def test_int4_gradients_train_close_to_unquantized():
    """int4 gradients (alone, and with int8 weights) against unquantized training: losses
    within 5% at every step (measured at most 3.6% alone, 3.7% with int8 weights, 1.3% with
    int4 weights), falling; the reduction sends about an
    eighth of fp32's bytes (int4 values and fp32 scales)."""
    result = run_on_ranks(_train_int4_grads, 2, 8)[0]
    for key, tol in (("grads", 0.05), ("both", 0.05), ("both4", 0.05)):
        r = result[key]
        for ref, quant in zip(result["ref"], r["losses"]):
            assert abs(quant - ref) <= tol * ref, (key, result["ref"], r["losses"])
        assert r["losses"][-1] < 0.8 * r["losses"][0]
        assert r["dtypes"] == {"torch.float32"}
    (ref_ag, ref_rs, _), (g_ag, g_rs, _) = result["ref_sent"], result["grads"]["sent"]
    assert g_ag == ref_ag  # weights gathered as before
    assert 0.125 < g_rs / ref_rs < 0.14, (g_rs, ref_rs)  # int4 values and fp32 scales against fp32


def _bf16_int4_bytes(weights: str | None) -> dict:
    bf16 = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    base = _unquantized(2, bf16=True)
    quant = _train_transformer("fsdp2", 2, comm_policy=fsdp2.QuantizedComm(weights=weights, gradients="int4"),
                               mp_policy=bf16)
    return {"base": base["sent"], "quant": quant["sent"], "losses": (base["losses"], quant["losses"])}


def test_int8_weights_and_int4_gradients_against_bf16_bytes():
    """int8 weights and int4 gradients against ``MixedPrecisionPolicy(bf16, bf16)`` (block 256):
    0.426x of bf16's bytes per step (measured; all-gather 0.517x, reduction 0.259x): int8
    weights keep the total above the issue's 0.30x."""
    result = run_on_ranks(_bf16_int4_bytes, 2, "int8")[0]
    (b_ag, b_rs, _), (q_ag, q_rs, _) = result["base"], result["quant"]
    assert 0.40 < (q_ag + q_rs) / (b_ag + b_rs) < 0.45
    assert 0.25 < q_rs / b_rs < 0.3, (result["base"], result["quant"])
    base, quant = result["losses"]
    assert abs(quant[-1] - base[-1]) <= 0.05 * base[-1]


def test_int4_weights_and_gradients_against_bf16_bytes():
    """int4 weights and int4 gradients against ``MixedPrecisionPolicy(bf16, bf16)`` (block 256):
    0.267x of bf16's bytes per step (measured; all-gather 0.271x, reduction 0.259x), under
    issue #29's 0.30x."""
    result = run_on_ranks(_bf16_int4_bytes, 2, "int4")[0]
    (b_ag, b_rs, _), (q_ag, q_rs, _) = result["base"], result["quant"]
    assert 0.25 < (q_ag + q_rs) / (b_ag + b_rs) < 0.28, (result["base"], result["quant"])
    assert 0.26 < q_ag / b_ag < 0.28
    base, quant = result["losses"]
    assert abs(quant[-1] - base[-1]) <= 0.05 * base[-1]
