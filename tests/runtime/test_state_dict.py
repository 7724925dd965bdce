"""``state_dict`` / ``load_state_dict`` on fully_shard-ed modules.

Saving returns this rank's shards as DTensors under the unsharded model's keys in every
module state, with no collective; loading accepts those DTensors or full plain tensors
(each rank keeps its rows), uneven and empty shards included.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp2 import fully_shard, record_schedule
from tests._dist import run_on_ranks
from tests._models import Transformer, make_batch


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _shard(model: nn.Module) -> nn.Module:
    mesh = _mesh()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


class _Odd(nn.Module):
    """Rows that do not divide 4 ranks (3 rows: rank 3 holds an empty shard, next to a non-empty
    one in the root's group), tied weights."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 5)
        self.layers = nn.ModuleList([nn.Linear(5, 3), nn.Linear(3, 5)])
        self.head = nn.Linear(5, 7, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](self.emb(tokens))) * self.scale
        x = torch.tanh(self.layers[1](x))
        return self.head(x)


def _check_sharded(sd: dict, ref: nn.Module) -> None:
    ref_sd = ref.state_dict()
    assert list(sd) == list(ref_sd), (list(sd), list(ref_sd))
    for key, value in sd.items():
        assert isinstance(value, DTensor), (key, type(value))
        assert value.placements == (Shard(0),), (key, value.placements)
        assert not isinstance(value, nn.Parameter), key
        rows = ref_sd[key].chunk(dist.get_world_size())  # ceil-sized chunks, as fsdp2 shards
        rank = dist.get_rank()
        expected = rows[rank] if rank < len(rows) else ref_sd[key][:0]
        torch.testing.assert_close(value.to_local(), expected, atol=0, rtol=0, msg=key)


def _state_dict_in_every_state() -> list[str]:
    ref = Transformer()
    model = _shard(copy.deepcopy(ref))
    seen = []
    tokens, _ = make_batch(dist.get_rank(), 0)
    with record_schedule() as events:
        _check_sharded(model.state_dict(), ref)
        model.unshard()
        model.layers[0].unshard()
        before = len(events)
        _check_sharded(model.state_dict(), ref)
        assert len(events) == before, events[before:]  # no gather, no reshard
        # The modules still hold the full parameters after state_dict().
        assert not isinstance(model.tok_emb.weight, DTensor)
        assert not isinstance(model.layers[0].qkv.weight, DTensor)
        kept = model.state_dict(keep_vars=True)["tok_emb.weight"]
        assert isinstance(kept, nn.Parameter) and isinstance(kept, DTensor)  # the sharded parameter
        model.reshard()
        model.layers[0].reshard()
        seen.append("explicit unshard")
        model(tokens)  # grad forward: the root keeps its parameters for backward
        assert not isinstance(model.tok_emb.weight, DTensor)
        _check_sharded(model.state_dict(), ref)
        model.reshard()
        seen.append("grad forward")
        with torch.no_grad():
            model(tokens)
        _check_sharded(model.state_dict(), ref)
        seen.append("no_grad forward")
    sub = model.layers[1].state_dict(prefix="x.")
    assert list(sub) == ["x." + k for k in ref.layers[1].state_dict()]
    return seen


def test_state_dict_is_sharded_in_every_module_state():
    for seen in run_on_ranks(_state_dict_in_every_state, 2):
        assert seen == ["explicit unshard", "grad forward", "no_grad forward"]


def _load_full_and_sharded() -> None:
    ref = _Odd()
    model = copy.deepcopy(ref)
    mesh = _mesh()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(1)
    source = _Odd()  # different weights to load
    tokens = torch.randint(0, 7, (2, 4))

    local_data = {name: p.to_local().data_ptr() for name, p in model.named_parameters()}
    result = model.load_state_dict(source.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    # Copied into the shards in place: no storage replaced (rank 3 holds empty shards of some).
    assert {name: p.to_local().data_ptr() for name, p in model.named_parameters()} == local_data
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value.full_tensor(), source.state_dict()[key], atol=0, rtol=0, msg=key)
    assert model.head.weight is model.emb.weight  # still tied, still the registered DTensor
    torch.testing.assert_close(model(tokens), source(tokens))

    # A sharded state dict (from another sharded copy) loads too, as do CPU bf16 full tensors.
    other = copy.deepcopy(ref)
    for layer in other.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(other, mesh=mesh)
    model.load_state_dict(other.state_dict(), strict=True)
    torch.testing.assert_close(model(tokens), ref(tokens))
    model.load_state_dict({k: v.bfloat16() for k, v in source.state_dict().items()})
    torch.testing.assert_close(model(tokens), source.bfloat16().float()(tokens))


def test_load_state_dict_accepts_full_and_sharded_tensors_uneven_shards():
    run_on_ranks(_load_full_and_sharded, 4)


def _load_while_unsharded() -> None:
    ref = Transformer()
    model = _shard(copy.deepcopy(ref))
    source = Transformer(seed=1)
    tokens, _ = make_batch(dist.get_rank(), 0)
    model.unshard()  # root holds full (soon stale) parameters
    model.load_state_dict(source.state_dict())
    assert isinstance(model.tok_emb.weight, DTensor)  # resharded: the gathered copy is stale
    torch.testing.assert_close(model(tokens), source(tokens))


def test_load_state_dict_after_unshard_uses_the_new_weights():
    run_on_ranks(_load_while_unsharded, 2)


def _load_errors() -> None:
    model = _shard(Transformer())
    bad = Transformer(dim=16, n_heads=4).state_dict()
    with pytest.raises(RuntimeError, match=r"size mismatch for tok_emb.weight: copying a param with shape "
                                           r"torch.Size\(\[64, 16\]\).*current model is torch.Size\(\[64, 32\]\)"):
        model.load_state_dict(bad)
    sd = Transformer().state_dict()
    del sd["norm.weight"]
    sd["extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"(?s)Missing key\(s\).*norm.weight.*Unexpected key\(s\).*extra"):
        model.load_state_dict(sd, strict=True)
    # assign=True: a DTensor laid out otherwise than the parameter it would replace is refused
    # before anything is assigned, even where it belongs to a group loaded after others.
    registered = {name: p for name, p in model.named_parameters()}
    values = {name: p.detach().full_tensor() for name, p in registered.items()}
    sd = {k: v.clone() for k, v in values.items()}
    sd["layers.2.mlp_norm.weight"] = distribute_tensor(sd["layers.2.mlp_norm.weight"], _mesh(), [Replicate()])
    with pytest.raises(ValueError, match=r"fsdp2: load_state_dict\(assign=True\): key 'layers.2.mlp_norm.weight' "
                                         r"is a DTensor \(Replicate\(\),\) on mesh \(2,\), "
                                         r"shape \(32,\); fsdp2 shards it \(Shard\(dim=0\),\) .*distribute_tensor"):
        model.load_state_dict(sd, assign=True)
    assert all(p is registered[name] for name, p in model.named_parameters())
    assert all(torch.equal(p.full_tensor(), values[name]) for name, p in model.named_parameters())
    # A plain parameter put in place of a sharded one: refused at the first forward, naming the fix.
    tokens, _ = make_batch(dist.get_rank(), 0)
    model.norm.weight = nn.Parameter(torch.ones(32))
    with pytest.raises(TypeError, match=r"fsdp2: parameter 'norm.weight' \(at its first use\) is a Parameter, but a "
                                        r"fully_shard-ed parameter stays a DTensor \(\(Shard\(dim=0\),\) on mesh .*"
                                        r"nn.Parameter\(distribute_tensor\(full, param.device_mesh, param.placements"):
        model(tokens)
    model.norm.weight = nn.Parameter(distribute_tensor(torch.ones(32), _mesh(), [Shard(0)]))
    model(tokens).sum().backward()  # taken at the retried lazy init
    assert model.norm.weight.grad is not None


def test_load_state_dict_errors_name_keys_and_shapes():
    run_on_ranks(_load_errors, 2)
