"""Meta-device initialisation: build on ``meta``, shard, ``to_empty``, then fill the shards.

The model has uneven dims on 2 ranks (vocab 61: 31 + 30 rows) and a ``(1, dim)`` gate
whose second rank holds zero rows, so the per-rank layout is exercised where it is
easiest to get wrong.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdp2 import fully_shard
from tests._dist import run_on_ranks
from tests._models import Transformer, lm_loss, make_batch
from tests._parity import assert_params_match, average_grads

VOCAB = 61  # odd: uneven shards on 2 ranks


class GatedTransformer(Transformer):
    """A Transformer whose final hidden state is scaled by a learned scalar gate."""

    def __init__(self) -> None:
        super().__init__(vocab=VOCAB)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.gate = nn.Linear(32, 1)  # weight (1, 32) and bias (1,): rank 1 holds 0 rows

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        x = x * torch.sigmoid(self.gate(x))
        return self.output(self.norm(x))


def _build_on_meta_and_shard() -> tuple[GatedTransformer, dict[str, nn.Parameter]]:
    with torch.device("meta"):
        model = GatedTransformer()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(p.device.type == "meta" for p in model.parameters())
    before = _registered(model)
    model.to_empty(device="cpu")
    after = _registered(model)
    assert after.keys() == before.keys()
    replaced = [name for name in before if after[name] is not before[name]]
    assert not replaced, f"to_empty replaced the parameter objects of {replaced}"
    return model, after


def _registered(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every (module, name) -> registered parameter object, duplicates included."""
    return {f"{mod_name}.{name}": p for mod_name, m in model.named_modules()
            for name, p in m._parameters.items() if p is not None}


def _train_against(ref: nn.Module, model: nn.Module, steps: int = 2) -> list[float]:
    rank = dist.get_rank()
    batch = lambda step: make_batch(rank, step, vocab=VOCAB)  # noqa: E731
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built after to_empty
    losses = []
    for step in range(steps):
        x, y = batch(step)
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        average_grads(ref)
        ref_opt.step()
        ref_opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {step}: {m}")
        losses.append(loss.item())
    assert_params_match(ref, model)
    return losses


def _load_full_weights() -> list[float]:
    ref = GatedTransformer()
    model, _ = _build_on_meta_and_shard()
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Only the slice distribute_tensor picks for this rank lands in the shard.
            local = distribute_tensor(ref_params[name].detach(), param.device_mesh, param.placements).to_local()
            param.to_local().copy_(local)
    return _train_against(ref, model)


def test_meta_build_then_loading_full_weights_trains_like_reference():
    losses = run_on_ranks(_load_full_weights, 2)
    assert all(math.isfinite(x) for r in losses for x in r)


def _expected_rows(n: int, rank: int, world: int) -> int:
    chunk = math.ceil(n / world)
    return max(0, min(chunk, n - rank * chunk))


def _reset_parameters() -> dict[str, list[int]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = {name: p.shape for name, p in GatedTransformer().named_parameters()}
    model, registered = _build_on_meta_and_shard()
    with torch.no_grad():
        for m in model.modules():
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
    local_rows = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.placements == (Shard(0),), (name, param)
        assert param.shape == shapes[name], (name, param.shape, shapes[name])
        local = param.to_local()
        expected = (_expected_rows(shapes[name][0], rank, world), *shapes[name][1:])
        assert tuple(local.shape) == expected, (name, tuple(local.shape), expected)
        assert torch.isfinite(local).all(), name
        local_rows[name] = local.shape[0]
    # Deterministic inits land where they belong in the full tensor.
    assert torch.equal(model.norm.weight.full_tensor(), torch.ones(32))
    assert torch.equal(model.norm.bias.full_tensor(), torch.zeros(32))
    bias = model.layers[0].mlp.in_proj.bias.full_tensor()  # uniform(+-1/sqrt(fan_in))
    assert bias.shape == (128,) and (bias.abs() <= 1 / math.sqrt(32)).all() and bias.std() > 0
    now = _registered(model)
    assert all(now[name] is p for name, p in registered.items()), "reset_parameters replaced parameters"

    # The re-initialised shards train exactly like an unsharded model started from them.
    ref = GatedTransformer()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(dict(model.named_parameters())[name].full_tensor())
    _train_against(ref, model)
    return local_rows


def test_meta_build_then_reset_parameters_gives_right_local_shapes_and_trains():
    rows = run_on_ranks(_reset_parameters, 2)
    assert rows[0]["tok_emb.weight"] == 31 and rows[1]["tok_emb.weight"] == 30
    assert rows[0]["gate.bias"] == 1 and rows[1]["gate.bias"] == 0
