"""Quantized communication on the CPU exchanges (``QuantizedComm`` with ``FSDP2_CPU_COLLECTIVES=exchange|read``).

A group on an exchange keeps it with a policy: its all-gather sends every rank's quantized
slice (the flat transport's bytes, ``_quantize.quantize_entries``) by messages or same-host
reads and dequantizes them into the unsharded buffer; its reduce-scatter quantizes each
destination rank's row of the gradients as the flat all-to-all does and moves the packed
rows point to point, and each rank sums the rows it received in the same order. The same ops
on the same bytes: training matches the flat transport's quantized training bit for bit
(losses and parameters), on 2 and 4 ranks and on HSDP 2 x 2 (``gradient_axes``), with error
feedback, int8 and int4, bf16 mixed precision; ``CommDebugMode`` sees the flat transport's
collectives; ``count_comm_bytes`` counts the quantized bytes on the exchange as
on the flat transport; with the policy off the exchange is unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from fsdp2.runtime._state import get_state
from tests._dist import environ, run_on_ranks
from tests._models import MLP, Transformer, train_steps

TRANSPORTS = ("flat", "exchange", "read")
POLICIES = {
    "int8": fsdp2.QuantizedComm(weights="int8", gradients="int8"),
    "int4-ef": fsdp2.QuantizedComm(weights="int4", gradients="int4", block_size=64, error_feedback=True),
    "both-ef": fsdp2.QuantizedComm(weights="int8", gradients="int8", block_size=64, error_feedback=True,
                                   gradient_axes="both"),
    "replicate": fsdp2.QuantizedComm(weights="int8", gradients="int4", gradient_axes="replicate"),
}
_MESHES: dict[str, object] = {}


def _mesh(hsdp: bool):
    """The world (1-D), or one 2 x 2 (replicate, shard) mesh per worker process (new process
    groups cost seconds; names of its own, so DTensor's cache hands out no other test's mesh)."""
    if not hsdp:
        return init_device_mesh("cpu", (dist.get_world_size(),))
    if "hsdp" not in _MESHES:
        _MESHES["hsdp"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("xq_replicate", "xq_shard"))
    return _MESHES["hsdp"]


def _train(transport: str, policy: fsdp2.QuantizedComm | None, hsdp: bool, dim: int, steps: int,
           bf16: bool = False) -> dict:
    """``steps`` AdamW steps of a 2-block Transformer of width ``dim``, every group built on
    ``transport`` (``bf16``: gathered in bf16, reduced in fp32): losses, this rank's parameter
    shards, the groups' transports, bytes counted."""
    mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"comm_policy": policy, **({"mp_policy": mp} if bf16 else {})}
    with environ(CPU_COLLECTIVES_ENV, transport):
        mesh = _mesh(hsdp)
        model = Transformer(dim=dim, n_layers=2)
        for block in model.layers:
            fsdp2.fully_shard(block, mesh=mesh, **kwargs)
        fsdp2.fully_shard(model, mesh=mesh, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with fsdp2.count_comm_bytes() as sent:
        losses = train_steps(model, opt, range(steps))
    groups = [get_state(m).group for m in model.modules() if isinstance(m, fsdp2.FSDPModule)]
    return {
        "losses": losses,
        "shards": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
        "names": {(g.gather_transport.name, g.reduce_transport.name) for g in groups},
        # the read exchange read (not fell back to messages) along the shard axis
        "reads": {g.transport.reads(g.process_group) for g in groups if g.transport.name == "read"},
        "sent": (sent.all_gather, sent.reduce_scatter, sent.all_reduce, dict(sent.calls)),
    }


def _every_transport(policy_name: str, hsdp: bool, dim: int, bf16: bool = False) -> dict:
    policy = POLICIES[policy_name]
    runs = {t: _train(t, policy, hsdp, dim, 3, bf16) for t in TRANSPORTS}
    runs["exchange off"] = _train("exchange", None, hsdp, dim, 3, bf16)
    runs["exchange empty policy"] = _train("exchange", fsdp2.QuantizedComm(), hsdp, dim, 3, bf16)
    return runs


def _check_matches_flat(runs: dict, shard_axis_quantized: bool = True) -> None:
    flat = runs["flat"]
    assert flat["names"] == {("flat", "flat")}
    for transport in ("exchange", "read"):
        run = runs[transport]
        assert run["names"] == {(transport, transport)}  # the exchange, both collectives
        assert run["losses"] == flat["losses"], (transport, run["losses"], flat["losses"])
        for name, shard in flat["shards"].items():
            assert torch.equal(run["shards"][name], shard), (transport, name)
        assert run["sent"] == flat["sent"], transport  # the quantized bytes, counted at the transport
    assert runs["read"]["reads"] == {True}
    off, empty = runs["exchange off"], runs["exchange empty policy"]
    assert off["losses"] != flat["losses"]  # it did quantize
    assert empty["losses"] == off["losses"] and empty["sent"] == off["sent"]
    for name, shard in off["shards"].items():  # nothing quantized: bit for bit the exchange's own path
        assert torch.equal(empty["shards"][name], shard), name
    # fewer bytes on the quantized collectives, the same number of them
    assert flat["sent"][0] < 0.6 * off["sent"][0]  # int8 against bf16 about 0.5x, against fp32 about 0.26x
    if shard_axis_quantized:
        assert flat["sent"][1] < off["sent"][1] / 3
    else:  # the shard axis' reduce-scatter unquantized, as on the flat transport
        assert flat["sent"][1] == off["sent"][1]
    assert flat["sent"][3] == off["sent"][3]


@pytest.mark.parametrize("world, policy, dim, bf16", [
    (2, "int8", 128, False),  # chunks of 64 KiB and more: one message each
    (2, "int4-ef", 32, False),  # small chunks: packed into one message per peer
    (2, "int8", 64, True),  # bf16 weights quantized, fp32 gradients
    (4, "int8", 32, False),
    (4, "int4-ef", 64, False),
])
def test_exchange_quantized_training_matches_flat(world, policy, dim, bf16):
    results = run_on_ranks(_every_transport, world, policy, False, dim, bf16, timeout=300)
    for runs in results:
        _check_matches_flat(runs)


@pytest.mark.parametrize("policy", ["both-ef", "replicate"])
def test_exchange_quantized_hsdp_matches_flat(policy):
    results = run_on_ranks(_every_transport, 4, policy, True, 64, timeout=300)
    for runs in results:
        _check_matches_flat(runs, shard_axis_quantized=policy != "replicate")
        assert runs["flat"]["sent"][2] < runs["exchange off"]["sent"][2] / 3  # the replicas' all-reduce
    # replicas hold the same parameters: global ranks r and r ^ 2 (xq_replicate is the outer axis)
    for r in range(4):
        for name, shard in results[r]["exchange"]["shards"].items():
            assert torch.equal(shard, results[r ^ 2]["exchange"]["shards"][name]), (r, name)


def _seen_by_comm_debug_mode(transport: str) -> dict[str, int]:
    """The collectives ``CommDebugMode`` counts in one step of a quantized MLP on ``transport``."""
    from torch.distributed.tensor.debug import CommDebugMode

    with environ(CPU_COLLECTIVES_ENV, transport):
        model = MLP(32)
        fsdp2.fully_shard(model, mesh=_mesh(False), comm_policy=POLICIES["int8"])
    x = torch.randn(2, 32, requires_grad=True)
    model(x).sum().backward()  # lazy init's bookkeeping outside the mode
    with CommDebugMode() as mode:
        model(x).sum().backward()
    return {str(op): n for op, n in mode.get_comm_counts().items()}


def test_comm_debug_mode_sees_the_flat_transports_collectives():
    # An exchange shows the flat collective it stands for, on meta tensors: here the all-gather
    # of the quantized slice and the reduction's all-to-all (docs/design.md, CommDebugMode).
    # (the root keeps its parameters after forward: one all-gather)
    counts = {t: run_on_ranks(_seen_by_comm_debug_mode, 2, t) for t in TRANSPORTS}
    assert counts["flat"] == [{"c10d._allgather_base_": 1, "c10d.alltoall_base_": 1}] * 2
    for t in ("exchange", "read"):
        assert counts[t] == counts["flat"], (t, counts)
