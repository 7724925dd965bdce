"""What a dispatch mode that counts collectives (torch's ``CommDebugMode``) sees: torch's count.

torch's FSDP2 issues one all-gather per group per unshard and one reduce-scatter per group
per backward (plus the all-reduce across replicas under HSDP), and tools and tests count
them with ``CommDebugMode``. fsdp2's CPU exchanges move the bytes by messages or same-host
reads instead, and fsdp2 checks the ranks' agreement at lazy init and probes the transport
once: the mode must still count exactly torch's collectives, on every transport, with the
numbers unchanged, and with the mode active on one rank only (the collectives it is shown
cost nothing and wait for no one).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from tests._dist import environ, run_on_ranks
from tests._models import Transformer, lm_loss, make_batch
from tests._parity import average_grads, full

STEPS = 2


def _shard(model: torch.nn.Module, fully_shard, mesh, reshard_after_forward) -> torch.nn.Module:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def _counts(mode: CommDebugMode | None) -> dict[str, int]:
    return {} if mode is None else {str(op): n for op, n in mode.get_comm_counts().items()}


def _count_collectives(transport: str, hsdp: bool, reshard_after_forward) -> dict[str, list]:
    """Train fsdp2 (with the finite-gradient check on: fsdp2's own collectives), torch's
    fully_shard and the unsharded reference; per step, what CommDebugMode counted in forward
    and in backward. The last step has the mode on rank 0 only."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard")) if hsdp \
        else init_device_mesh("cpu", (world,))
    dim = 128  # 0.75 MiB blocks: exchanges, where the transport is forced
    with environ(CPU_COLLECTIVES_ENV, transport):
        models = {"ref": Transformer(dim=dim, n_layers=2),
                  "fsdp2": _shard(Transformer(dim=dim, n_layers=2), fsdp2.fully_shard, mesh, reshard_after_forward),
                  "torch": _shard(Transformer(dim=dim, n_layers=2), torch_fully_shard, mesh, reshard_after_forward)}
    models["fsdp2"].set_check_finite_gradients(True)
    counted: dict[str, list] = {"fsdp2": [], "torch": []}
    for step in range(STEPS):
        inputs, targets = make_batch(dist.get_rank(), step)
        watched = step < STEPS - 1 or dist.get_rank() == 0
        losses = {}
        for name, model in models.items():
            fwd = CommDebugMode() if watched and name != "ref" else None
            with fwd or torch.enable_grad():
                loss = lm_loss(model(inputs), targets)
            bwd = CommDebugMode() if watched and name != "ref" else None
            with bwd or torch.enable_grad():
                loss.backward()
            losses[name] = loss.detach()
            if name != "ref":
                counted[name].append((_counts(fwd), _counts(bwd)))
        average_grads(models["ref"])
        for name in ("fsdp2", "torch"):
            torch.testing.assert_close(losses[name], losses["ref"])
            for (pname, p), ref in zip(models[name].named_parameters(), models["ref"].parameters()):
                torch.testing.assert_close(full(p.grad), ref.grad, msg=lambda m: f"{name} {pname}: {m}")
        for model in models.values():
            model.zero_grad()
    group = models["fsdp2"].layers[0]._fsdp2_state.group
    counted["exchanges"] = group.transport.gathers_in_place
    return counted


@pytest.mark.parametrize("transport", ["flat", "exchange", "read"])
@pytest.mark.parametrize("reshard_after_forward", [True, None])
def test_comm_debug_mode_counts_what_torch_issues(transport, reshard_after_forward):
    for rank, counted in enumerate(run_on_ranks(_count_collectives, 2, transport, False, reshard_after_forward)):
        assert counted["exchanges"] == (transport != "flat")
        assert counted["fsdp2"] == counted["torch"], counted
        first_forward, first_backward = counted["fsdp2"][0]
        # three groups: one all-gather each in forward, one reduce-scatter each in backward
        assert first_forward == {"c10d._allgather_base_": 3}, first_forward
        assert first_backward["c10d._reduce_scatter_base_"] == 3, first_backward
        assert (counted["fsdp2"][-1] == ({}, {})) == (rank != 0)  # the mode on rank 0 only, no hang


@pytest.mark.slow
def test_comm_debug_mode_counts_hsdp_all_reduces():
    for counted in run_on_ranks(_count_collectives, 4, "read", True, True):
        assert counted["fsdp2"] == counted["torch"], counted
        assert counted["fsdp2"][0][1]["c10d.allreduce_"] == 3, counted["fsdp2"][0]
