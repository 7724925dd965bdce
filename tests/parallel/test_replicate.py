"""fsdp2 beside torch's composable ``replicate()`` (DDP), as torch's ``fully_shard`` composes with it.

torch's composable APIs find each other through a registry they keep on every module:
``replicate(model)`` leaves the parameters of submodules registered as ``"fully_shard"`` to
them and refuses a module already registered so, and ``fully_shard`` leaves a ``replicate``d
submodule's parameters to DDP. fsdp2 registers itself there too. Without it, ``replicate``
wrapped fsdp2's sharded parameters as its own and training went silently wrong (losses 15%
off torch's after a few steps).

The model follows the pattern of overlapping a user's own collectives with explicit
prefetches: blocks that each start an async all-reduce of their output, each followed by
``unshard(async_op=True)`` of the sharded MLP that will consume it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from tests._dist import environ, run_on_ranks
from tests._models import MLP


class _Reduce(nn.Module):
    """A plain (DDP-replicated) weight whose output is all-reduced asynchronously."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dist.Work]:
        y = F.relu(x @ self.weight)
        return y, dist.all_reduce(y, async_op=True)  # not differentiated: only overlapped


class _Heads(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList(MLP(dim) for _ in range(3))

    def forward(self, ys: list[torch.Tensor], works: list[dist.Work]) -> torch.Tensor:
        out = 0
        for head, y, work in zip(self.heads, ys, works):
            work.wait()
            out = out + head(y)
        return out


class _Model(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.reduces = nn.ModuleList(_Reduce(dim) for _ in range(3))
        self.mlps = _Heads(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys, works = [], []
        for reduce, head in zip(self.reduces, self.mlps.heads):
            y, work = reduce(x)
            ys.append(y)
            works.append(work)
            if hasattr(head, "unshard"):
                head.unshard(async_op=True)  # gathered while the all-reduce is in flight
        return self.mlps(ys, works)


def _sharded(ref: _Model, fully_shard) -> _Model:
    model = copy.deepcopy(ref)
    for head in model.mlps.heads:
        fully_shard(head, reshard_after_forward=False)
    fully_shard(model.mlps)
    replicate(model)
    return model


def _train_beside_replicate(transport: str) -> list[float]:
    """Ten steps of a replicate()d model whose heads fsdp2 shards: the same losses as the
    model all replicate()d and as torch's fully_shard in fsdp2's place."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(42)
    base = _Model(8)
    ref = replicate(copy.deepcopy(base))
    with environ(CPU_COLLECTIVES_ENV, transport):
        ours = _sharded(base, fsdp2.fully_shard)
    theirs = _sharded(base, torch_fully_shard)
    # replicate() kept its hands off fsdp2's parameters: they are DTensors, the others plain.
    assert all(isinstance(p, DTensor) for p in ours.mlps.parameters())
    assert not any(isinstance(p, DTensor) for p in ours.reduces.parameters())
    models = {"ref": ref, "fsdp2": ours, "torch": theirs}
    opts = {name: torch.optim.Adam(m.parameters(), lr=1e-2) for name, m in models.items()}
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(43 + dist.get_rank()))
    losses = []
    for step in range(10):
        got = {}
        for name, model in models.items():
            got[name] = model(x).sum()
            got[name].backward()
            with implicit_replication():
                opts[name].step()
            opts[name].zero_grad()
        torch.testing.assert_close(got["fsdp2"], got["ref"], msg=lambda m: f"step {step} vs replicate(): {m}")
        torch.testing.assert_close(got["fsdp2"], got["torch"], msg=lambda m: f"step {step} vs torch: {m}")
        losses.append(got["fsdp2"].item())
    return losses


@pytest.mark.parametrize("transport", ["flat", "auto"])
def test_replicate_leaves_fsdp2_parameters_alone_and_trains_as_torch(transport):
    losses = run_on_ranks(_train_beside_replicate, 2, transport)
    assert losses[0] == losses[1] and len(set(losses[0])) == 10


def _registry_and_refusals() -> list[bool]:
    from torch.distributed._composable.contract import _get_registry

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(MLP(8), MLP(8))
    replicate(model[0])  # DDP owns this submodule: fully_shard on the parent leaves it alone
    fsdp2.fully_shard(model, mesh=mesh)
    kept_plain = not any(isinstance(p, DTensor) for p in model[0].parameters())
    sharded = all(isinstance(p, DTensor) for p in model[1].parameters())
    registered = "fully_shard" in (_get_registry(model) or {})
    with pytest.raises(RuntimeError, match="already managed by `fully_shard`"):
        replicate(model)  # torch's own refusal, now that it sees fsdp2
    # A fully_shard that fails leaves no registration behind.
    bad = MLP(8)
    with pytest.raises(ValueError):
        fsdp2.fully_shard(bad, mesh=mesh, reshard_after_forward=3)
    return [kept_plain, sharded, registered, "fully_shard" not in (_get_registry(bad) or {})]


def test_fully_shard_registers_where_torchs_composable_apis_look():
    for flags in run_on_ranks(_registry_and_refusals, 2):
        assert flags == [True, True, True, True], flags
