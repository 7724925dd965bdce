"""Two nodes on one machine: ``FSDP2_NODE`` names each rank's node (``fsdp2/comm/cpu/_cma.py``).

Ranks of one host read each other's memory; ranks whose ``FSDP2_NODE`` differs never do, and
send messages instead, as ranks on two machines do. Here four ranks of one host are two nodes
(ranks 0-1 node "0", ranks 2-3 node "1", as ``torchrun --nnodes 2 --nproc-per-node 2`` numbers
them): each process group's probe says whether it reads, an HSDP mesh reads along its shard
axis (inside a node) and not along its replicate axis (across), FSDP over both nodes moves its
data by messages and computes what one node computes by reads, bit for bit. A bad value fails
on every rank of the group with one message. The recipe on this layout under torchrun:
tests/tools/test_recipe_nodes.py.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from fsdp2.comm.cpu import _cma, _pipes
from fsdp2.comm.cpu._transport import probe_reads
from tests._dist import environ, run_on_ranks
from tests._models import MLP


def _two_nodes() -> contextlib.AbstractContextManager[None]:
    """This rank's ``FSDP2_NODE`` as two launches of two ranks each would set it."""
    return environ(_cma.NODE_ENV, str(dist.get_rank() // 2))


def _verdicts_by_group() -> dict[str, object]:
    """Each group's probe verdict with ranks 0-1 and 2-3 on two nodes, and without nodes."""
    world = dist.new_group()
    alone = dist.new_group()
    try:
        with _two_nodes():
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("nodes_replicate", "nodes_shard"))
            shard, replicate = mesh.get_group("nodes_shard"), mesh.get_group("nodes_replicate")
            verdicts = {"shard": probe_reads(shard), "replicate": probe_reads(replicate), "world": probe_reads(world)}
        verdicts["world without FSDP2_NODE"] = probe_reads(alone)
        return {**verdicts, "usable": [_cma.usable(pg) for pg in (shard, replicate, world, alone)],
                "shard pipes": isinstance(_pipes.link(shard), _pipes.Pipes),
                "replicate pipes": _pipes.link(replicate) is replicate}
    finally:
        dist.destroy_process_group(world)
        dist.destroy_process_group(alone)


def test_ranks_of_different_nodes_never_read_each_other():
    # The replicate axis crosses the nodes (ranks 0-2, 1-3): no reads, no pipes; the shard axis
    # stays inside one (0-1, 2-3): reads, and its small messages on pipes (the replicate axis's
    # stay on gloo).
    expected = {"shard": True, "replicate": False, "world": False, "world without FSDP2_NODE": True,
                "usable": [True, False, False, True], "shard pipes": True, "replicate pipes": True}
    assert run_on_ranks(_verdicts_by_group, 4) == [expected] * 4


def _grads_across_nodes(axes: tuple[str, ...], nodes: bool, transport: str = "auto") -> tuple[list[torch.Tensor], bool]:
    """One forward and backward of a 2 MiB MLP (exchanges, not flat collectives, under ``auto``)
    sharded over ``axes`` (FSDP: one axis of 4; HSDP: replicate 2 x shard 2), on two nodes or
    one; its gradients, whether the shard axis read, and the bytes counted (two nodes of two
    ranks; and the default, one node: the pool's ``LOCAL_WORLD_SIZE`` is the world)."""
    with _two_nodes() if nodes else contextlib.nullcontext(), environ(CPU_COLLECTIVES_ENV, transport):
        # Names of their own: DTensor's cache must not hand this mesh's tensors another test's equal mesh.
        names = tuple(f"{axis}_{int(nodes)}_{transport}" for axis in axes)
        if len(axes) == 1:  # a group of its own: a 1-D init_device_mesh takes the world's, probed already
            mesh = DeviceMesh.from_group(dist.new_group(), "cpu", mesh_dim_names=names)
        else:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        torch.manual_seed(0)
        model = MLP(256)  # 2 x 256 x 1024 fp32
        fsdp2.fully_shard(model, mesh=mesh)
        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(dist.get_rank()))
        with fsdp2.count_comm_bytes(ranks_per_node=2) as sent, fsdp2.count_comm_bytes() as one_node:
            model(x).square().sum().backward()  # the first all-gather probes the shard axis
    with torch.no_grad():
        grads = [p.grad.full_tensor() for p in model.parameters()]
    counts = {"total": sent.total, "all_reduce": sent.all_reduce, "across_nodes": sent.across_nodes,
              "one node": (one_node.total, one_node.across_nodes)}
    return grads, _cma.usable(mesh.get_group(names[-1])), counts


@pytest.mark.parametrize("axes", [("fsdp",), ("hsdp_replicate", "hsdp_shard")], ids=["fsdp", "hsdp"])
def test_sharding_across_nodes_matches_one_node(axes):
    # FSDP over both nodes sends messages (its shard axis crosses them); HSDP reads along its
    # shard axis (inside a node) and all-reduces across, as on one node. Same gradients, bit for bit.
    across = run_on_ranks(_grads_across_nodes, 4, axes, True)
    one_node = run_on_ranks(_grads_across_nodes, 4, axes, False)
    assert [read for _, read, _ in across] == [len(axes) == 2] * 4
    assert [read for _, read, _ in one_node] == [True] * 4
    for (grads, _, _), (expected, _, _) in zip(across, one_node):
        assert all(torch.equal(g, e) for g, e in zip(grads, expected))
    # count_comm_bytes' across_nodes: FSDP sends 2 of each 3 peers' bytes to the other node;
    # HSDP only its all-reduce (over the replicate axis, which crosses). Counted by the layout,
    # so the same with FSDP2_NODE set or not.
    for _, _, counts in across + one_node:
        assert counts["total"] > 0 and counts["one node"] == (counts["total"], 0)
        if len(axes) == 1:
            assert counts["all_reduce"] == 0 and 3 * counts["across_nodes"] == 2 * counts["total"]
        else:
            assert counts["across_nodes"] == counts["all_reduce"] > 0


def _reads_demanded_across_nodes() -> str:
    with pytest.raises(RuntimeError) as info:
        _grads_across_nodes(("demanded",), True, "read")
    return str(info.value)


def test_reads_demanded_across_nodes_are_an_error():
    # FSDP2_CPU_COLLECTIVES=read: a shard axis that crosses nodes is refused at its first all-gather.
    said = run_on_ranks(_reads_demanded_across_nodes, 4)
    assert said == ["FSDP2_CPU_COLLECTIVES=read: the ranks [0, 1, 2, 3] cannot read each other's memory with "
                    "process_vm_readv (different hosts or PID namespaces, ptrace restrictions, or a seccomp "
                    "filter); use 'auto' to fall back to messages"] * 4


def _probe_with_a_bad_node_name(value: str) -> str:
    pg = dist.new_group()
    try:
        with environ(_cma.NODE_ENV, value) if dist.get_rank() == 1 else contextlib.nullcontext():
            with pytest.raises(ValueError) as info:
                _cma.probe(pg)
        return str(info.value)
    finally:
        dist.destroy_process_group(pg)


def test_a_bad_node_name_fails_on_every_rank():
    # Rank 1's value alone is bad: rank 0 raises the same error instead of waiting for rank 1.
    said = run_on_ranks(_probe_with_a_bad_node_name, 2, "node 1")
    assert said == ["fsdp2: FSDP2_NODE='node 1' is not a node name: use 1 to 64 letters, digits, '.', '_' or "
                    "'-', starting with a letter or digit, the same on every rank of one node (e.g. FSDP2_NODE=0 "
                    "for the first launch's ranks, FSDP2_NODE=1 for the second's), or unset it (rank 1's "
                    "environment)"] * 2


@pytest.mark.parametrize("value", ["", " 0", "0 ", "node 1", "-1", "a/b", "n" * 65, "nœud"])
def test_node_names_are_checked(monkeypatch, value):
    monkeypatch.setenv(_cma.NODE_ENV, value)
    with pytest.raises(ValueError, match=rf"FSDP2_NODE={re.escape(repr(value))} is not a node name: .* or unset it$"):
        _cma.node()


def test_node_names(monkeypatch):
    monkeypatch.delenv(_cma.NODE_ENV, raising=False)
    assert _cma.node() == ""
    host = _cma._host()
    for value in ("0", "1", "node-1.example.com", "gpu_07", "n" * 64):
        monkeypatch.setenv(_cma.NODE_ENV, value)
        assert _cma.node() == value
        assert _cma._host() != host  # named nodes of one host are apart from it and from each other
        host = _cma._host()


@pytest.mark.parametrize("value, error, match", [
    (0, ValueError, "ranks_per_node=0 must be at least 1"),
    (2.0, TypeError, "ranks_per_node must be an int, got float"),
    (True, TypeError, "ranks_per_node must be an int, got bool"),
])
def test_count_comm_bytes_checks_ranks_per_node(value, error, match):
    with pytest.raises(error, match=match), fsdp2.count_comm_bytes(ranks_per_node=value):
        pass
