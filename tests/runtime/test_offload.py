"""CPUOffloadPolicy: sharded parameters and gradients live on the CPU; numbers unchanged.

On the CPU mesh every copy is a no-op, so this pins the semantics (parity, where the
shards and gradient shards live, their DTensor layout), not transfer speed.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp2 import CPUOffloadPolicy, fully_shard
from tests._dist import run_on_ranks
from tests._models import Transformer, lm_loss, make_batch
from tests._parity import train_parity


def _shard(model: torch.nn.Module, policy: CPUOffloadPolicy) -> None:
    for block in model.layers:
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)


def _offload(pin_memory: bool) -> None:
    policy = CPUOffloadPolicy(pin_memory=pin_memory)
    holder = []

    def shard(model):
        _shard(model, policy)
        holder.append(model)

    train_parity(Transformer, shard, steps=3)
    model = holder[0]
    x, y = make_batch(dist.get_rank(), 7)
    lm_loss(model(x), y).backward()
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.to_local().device.type == "cpu", name
        grad = p.grad
        assert isinstance(grad, DTensor), (name, type(grad))
        assert grad.placements == p.placements and grad.device_mesh == p.device_mesh, name
        assert grad.to_local().device.type == "cpu" and grad.to_local().shape == p.to_local().shape, name
        assert torch.isfinite(grad.to_local()).all(), name


@pytest.mark.parametrize("pin_memory", [True, False])
def test_cpu_offload_matches_reference_with_shards_and_grads_on_cpu(pin_memory):
    run_on_ranks(_offload, 2, pin_memory)
