"""Meta-device initialisation: build on ``meta``, shard, then materialize and fill the shards.

By ``to_empty`` and an init or a copy, by ``load_state_dict(assign=True)`` (torchtune's
pattern: DTensors from ``distribute_tensor``, or full tensors), by DCP's
``set_model_state_dict(..., broadcast_from_rank0=True)`` (which turns assign on itself), and
by a parameter assigned before the first forward (torch's ``reset_sharded_param``); each
against an unsharded reference and torch's ``fully_shard`` doing the same. A model never
materialized is refused at its first forward, naming the parameters.

The model has uneven dims on 2 ranks (vocab 61: 31 + 30 rows) and a ``(1, dim)`` gate
whose second rank holds zero rows, so the per-rank layout is exercised where it is
easiest to get wrong.
"""

from __future__ import annotations

import math

import pytest
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


def _meta_sharded(shard=fully_shard) -> GatedTransformer:
    with torch.device("meta"):
        model = GatedTransformer()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    assert all(p.device.type == "meta" for p in model.parameters())
    return model


def _build_on_meta_and_shard() -> tuple[GatedTransformer, dict[str, nn.Parameter]]:
    model = _meta_sharded()
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


# ---- loading into a model that was never materialized ------------------------------------------
def _torch_fully_shard():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return torch_fully_shard


def _shard_of(impl: str):
    return fully_shard if impl == "fsdp2" else _torch_fully_shard()


def _assert_loaded(model: nn.Module, ref: nn.Module) -> None:
    """Every parameter a DTensor on the CPU holding the reference's values."""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device.type == "cpu", (name, type(p), p.device)
        torch.testing.assert_close(p.full_tensor(), ref_params[name].detach(), atol=0, rtol=0, msg=name)


def _torchtune_load(impl: str) -> list[float]:
    """torchtune's ``load_from_full_model_state_dict``: DTensors laid out as the meta shards, assigned."""
    ref = GatedTransformer()
    model = _meta_sharded(_shard_of(impl))
    full_sd = ref.state_dict()
    sharded_sd = {}
    for name, meta in model.state_dict().items():
        sharded = distribute_tensor(full_sd[name].to(meta.dtype), meta.device_mesh, meta.placements)
        sharded_sd[name] = nn.Parameter(sharded)
    result = model.load_state_dict(sharded_sd, strict=True, assign=True)
    assert not result.missing_keys and not result.unexpected_keys
    _assert_loaded(model, ref)
    return _train_against(ref, model)


@pytest.mark.parametrize("load", ["torchtune", "broadcast_from_rank0"])
def test_meta_model_loaded_with_assign_trains_like_reference_and_torch(load):
    fn = _torchtune_load if load == "torchtune" else _broadcast_from_rank0
    torch.testing.assert_close(run_on_ranks(fn, 2, "fsdp2"), run_on_ranks(fn, 2, "torch"))


def _broadcast_from_rank0(impl: str) -> list[float]:
    """DCP's full-state-dict load from rank 0 (torchtune's and torchtitan's resume path): it
    broadcasts each tensor, cuts each rank's shard and loads with assign=True (meta model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    ref = GatedTransformer()
    model = _meta_sharded(_shard_of(impl))
    full_sd = ref.state_dict() if dist.get_rank() == 0 else {}
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _assert_loaded(model, ref)
    return _train_against(ref, model)


class _Tied(nn.Module):
    """An embedding tied to the output head, in the root's group: uneven on 2 ranks (7 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 6)
        self.block = nn.Linear(6, 6)
        self.head = nn.Linear(6, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(self.emb(tokens))))


def _full_tensors_assigned() -> None:
    torch.manual_seed(0)
    ref = _Tied()
    with torch.device("meta"):
        model = _Tied()
    fully_shard(model.block)
    fully_shard(model)
    full_sd = ref.state_dict()
    model.load_state_dict(full_sd, assign=True)  # full plain tensors: each rank keeps its rows
    assert model.head.weight is model.emb.weight  # still tied
    _assert_loaded(model, ref)
    # Copied out: the shard does not keep the full tensor alive.
    local = model.emb.weight.to_local()
    assert local.untyped_storage().data_ptr() != full_sd["emb.weight"].untyped_storage().data_ptr()
    mesh = model.emb.weight.device_mesh
    tokens = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(dist.get_rank()))
    torch.testing.assert_close(model(tokens), ref(tokens))
    # A sharded state dict assigned again, after a forward whose backward never came (the root
    # holds its unsharded parameters): the values of another model.
    torch.manual_seed(1)
    other = _Tied()
    model.load_state_dict({k: distribute_tensor(v, mesh, [Shard(0)])
                           for k, v in other.state_dict().items()}, assign=True)
    assert model.head.weight is model.emb.weight
    torch.testing.assert_close(model(tokens), other(tokens))


def test_full_tensors_and_tied_parameters_load_with_assign():
    run_on_ranks(_full_tensors_assigned, 2)


def _assigned_before_first_forward(impl: str) -> list[float]:
    """Parameters replaced after fully_shard, before the first forward, by DTensors computed from
    other shards (DoRA-style magnitudes): taken at lazy init, as torch's ``reset_sharded_param``."""
    ref = GatedTransformer()
    model = _meta_sharded(_shard_of(impl))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(distribute_tensor(dict(ref.named_parameters())[name].detach(), p.device_mesh,
                                                 p.placements).to_local())
        # New parameter objects, uneven (61 rows) and computed from sharded values.
        model.output.weight = nn.Parameter(model.tok_emb.weight * 0.5)
        model.norm.weight = nn.Parameter(model.norm.weight + 1.0)
        ref.output.weight = nn.Parameter(ref.tok_emb.weight.detach() * 0.5)
        ref.norm.weight = nn.Parameter(ref.norm.weight.detach() + 1.0)
    return _train_against(ref, model)


def test_parameters_assigned_before_the_first_forward_are_sharded_and_train():
    torch.testing.assert_close(run_on_ranks(_assigned_before_first_forward, 2, "fsdp2"),
                               run_on_ranks(_assigned_before_first_forward, 2, "torch"))


def _never_materialized() -> list[str]:
    model = _meta_sharded()
    tokens, _ = make_batch(dist.get_rank(), 0, vocab=VOCAB)
    messages = []
    for call in (lambda: model.layers[1].unshard(), lambda: model(tokens)):  # before and at lazy init
        with pytest.raises(RuntimeError, match=r"parameters still on the meta device at their first use: \[") as err:
            call()
        messages.append(str(err.value))
    assert isinstance(model.tok_emb.weight, DTensor)  # still sharded
    # Materialized afterwards, the same model trains.
    ref = GatedTransformer()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(dict(ref.named_parameters())[name].detach(), p.device_mesh, p.placements))
    _train_against(ref, model, steps=1)
    return messages


def test_a_model_never_materialized_is_refused_naming_its_parameters():
    unshard, forward = run_on_ranks(_never_materialized, 2)[0]
    assert "['attn_norm.weight', 'attn_norm.bias', 'qkv.weight'" in unshard  # names in its own group
    assert "['tok_emb.weight', 'pos_emb.weight', 'norm.weight'" in forward and " more." in forward
    assert "model.to_empty(device=...)" in forward and "reset_parameters()" in forward
