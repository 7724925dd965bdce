"""HSDP's all-reduce across replicas, quantized: ``QuantizedComm(gradient_axes="replicate"|"both")``.

On a (replicate, shard) mesh the all-reduce across replicas is usually the reduction that
leaves a node. With ``gradient_axes="replicate"`` it runs as an all-to-all of quantized chunks,
a local fp32 sum and an all-gather of the quantized sum (``comm/_collectives._quantized_all_reduce``);
the reduce-scatter inside the replica stays exact. Every replica dequantizes the same bytes, so
replicas hold bit-identical gradients (and so parameters), which is what HSDP promises.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2._format import aligned
from tests._dist import run_on_ranks
from tests._models import MLP
from tests._parity import full


_MESHES: dict[tuple[int, ...], object] = {}


def _hsdp_mesh():
    """One 2 x 2 (replicate, shard) mesh per worker process: new process groups cost seconds."""
    if (2, 2) not in _MESHES:
        _MESHES[2, 2] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("q_replicate", "q_shard"))
    return _MESHES[2, 2]


def _hsdp_grads(gradient_axes: str | None, bits: str = "int8", block: int = 32) -> dict:
    """One backward of MLP(24, 40) on a 2 x 2 (replicate, shard) mesh; the full gradients,
    whether this rank's gradient shards equal the other replica's, the bytes counted."""
    torch.manual_seed(3)
    model = MLP(24, 40)
    policy = None if gradient_axes is None else fsdp2.QuantizedComm(gradients=bits, block_size=block,
                                                                     gradient_axes=gradient_axes)
    fsdp2.fully_shard(model, mesh=_hsdp_mesh(), comm_policy=policy)
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    x = torch.randn(6, 24, generator=g) * (1 + dist.get_rank())
    with fsdp2.count_comm_bytes() as sent:
        model(x).pow(2).sum().backward()
    local = torch.cat([p.grad.to_local().flatten() for p in model.parameters()])
    other = torch.empty_like(local)  # the same shard on the other replica: global ranks r and r ^ 2
    peer = dist.get_rank() ^ 2
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, local, peer), dist.P2POp(dist.irecv, other, peer)]):
        work.wait()
    return {"grads": [full(p.grad) for p in model.parameters()], "replicas_equal": torch.equal(local, other),
            "bytes": (sent.all_gather, sent.reduce_scatter, sent.all_reduce), "calls": dict(sent.calls)}


CASES = [("replicate", "int8"), ("both", "int8"), ("replicate", "int4")]


def _every_case() -> dict:
    return {case: _hsdp_grads(*case) for case in [(None, "int8"), *CASES]}


def test_quantized_all_reduce_across_replicas():
    # measured relative errors of a parameter's gradient (blocks of 32 over chunks that mix the
    # MLP's four parameters): int8 0.5-1.9% with "replicate" or "both", int4 7-24%
    tolerance = {"int8": 0.03, "int4": 0.4}
    results = run_on_ranks(_every_case, 4)
    for axes, bits in CASES:
        for by_case in results:
            exact, quant = by_case[None, "int8"], by_case[axes, bits]
            assert quant["replicas_equal"] and exact["replicas_equal"]  # replicas equal, bit for bit
            for a, b in zip(quant["grads"], exact["grads"]):
                assert not torch.equal(a, b)  # it did quantize
                assert ((a - b).norm() / b.norm()).item() < tolerance[bits], (axes, bits)
        # Exact bytes: this rank's reduced row is 20 x 24 + 20 + 12 x 40 + 12 = 992 fp32 elements;
        # across 2 replicas, chunks of 496: 496 int8 values (int4: 248, aligned 256) + 16 fp32
        # scales (blocks of 32) each way, to the one peer (the all-to-all, then the all-gather of the sum).
        exact, quant = results[0][None, "int8"], results[0][axes, bits]
        chunk_bytes = aligned(496 if bits == "int8" else 248) + 4 * 16
        assert exact["bytes"][2] == 2 * 496 * 4
        assert quant["bytes"][2] == 2 * chunk_bytes
        assert (quant["bytes"][1] < exact["bytes"][1]) == (axes == "both")  # the shard axis: quantized too
        assert quant["calls"] == exact["calls"] and exact["calls"]["all_reduce"] == 1


def _train_hsdp(axes: str | None, steps: int) -> list[float]:
    mesh = _hsdp_mesh()
    torch.manual_seed(0)
    model = MLP(32, 64)
    policy = None if axes is None else fsdp2.QuantizedComm(weights="int8", gradients="int8", gradient_axes=axes)
    fsdp2.fully_shard(model, mesh=mesh, comm_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
    losses = []
    for _ in range(steps):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train_both_ways(steps: int) -> tuple[list[float], list[float]]:
    return _train_hsdp(None, steps), _train_hsdp("both", steps)


def test_hsdp_training_with_both_axes_quantized_follows_unquantized():
    for e, q in run_on_ranks(_train_both_ways, 4, 8):
        assert q[-1] < q[0] * 0.8  # it trains
        assert max(abs(a - b) / b for a, b in zip(q, e)) < 0.01


def _refused_on_a_1d_mesh() -> str:
    model = MLP(8, 16)
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as info:
        fsdp2.fully_shard(model, mesh=init_device_mesh("cpu", (2,)),
                          comm_policy=fsdp2.QuantizedComm(gradients="int8", gradient_axes="replicate"))
    assert dict(model.named_parameters()) == before and not isinstance(model, fsdp2.FSDPModule)
    return str(info.value)


def test_replicate_axis_needs_an_hsdp_mesh():
    said = run_on_ranks(_refused_on_a_1d_mesh, 2)[0]
    assert "gradient_axes='replicate'" in said and "2-D (replicate, shard) mesh" in said


@pytest.mark.parametrize("kwargs, error, match", [
    ({"gradients": "int8", "gradient_axes": "nodes"}, ValueError, "gradient_axes='nodes' is not supported"),
    ({"gradients": "int8", "gradient_axes": 1}, TypeError, "gradient_axes must be a str"),
    ({"gradient_axes": "replicate"}, ValueError, "needs quantized gradients"),
    ({"gradients": "int8", "gradient_axes": "replicate", "error_feedback": True}, ValueError,
     "error_feedback=True.*shard axis"),
])
def test_gradient_axes_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        fsdp2.QuantizedComm(**kwargs)


def test_gradient_axes_pick_the_reductions():
    shard, replicate, both = (fsdp2.QuantizedComm(gradients="int8", gradient_axes=a)
                              for a in ("shard", "replicate", "both"))
    assert (shard.grad_block, shard.replicate_grad_block) == (256, 0)
    assert (replicate.grad_block, replicate.replicate_grad_block) == (0, 256)
    assert (both.grad_block, both.replicate_grad_block) == (256, 256)


def test_a_non_finite_value_makes_its_block_nan_and_only_its_block():
    """What docs/quantized-comm.md says of inf and NaN: the block's scale is not finite, so the whole block
    comes back NaN (non-finite where the value was, as the finite checks need); other blocks
    are untouched."""
    from fsdp2.comm._quantize import GradChunks

    for bad in (float("inf"), float("nan")):
        rows = torch.randn(2, 70, generator=torch.Generator().manual_seed(0))
        rows[0, 40] = bad
        chunks = GradChunks(2, 70, 32)
        packed = torch.empty(2 * chunks.chunk_bytes, dtype=torch.uint8)
        chunks.quantize(rows, packed)
        back = chunks.dequantize(packed, torch.float32)[:, :70]
        assert back[0, 32:64].isnan().all()
        assert back[0, :32].isfinite().all() and back[0, 64:].isfinite().all() and back[1].isfinite().all()
