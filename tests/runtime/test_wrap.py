"""``fully_shard_auto``: which modules get their own groups, and that it trains exactly like
``fully_shard`` applied by hand to the same modules (fsdp2's and torch's) and like the
unsharded reference; bad arguments leave the model untouched.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.runtime._state import get_state
from tests._dist import info_records, run_on_ranks
from tests._models import MLP, Block, Transformer, train
from tests._parity import train_parity


class TiedTransformer(Transformer):
    """The output layer reuses the token embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.output.weight = self.tok_emb.weight


class SharedInBlock(nn.Module):
    """Two linears tying one weight inside one block: their common ancestor is the block."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.b.weight = self.a.weight
            self.c = nn.Linear(8, 8)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SharedInBlock() for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _groups(model: nn.Module) -> list[str]:
    """The names of the modules that got a group, in module order ("" is the root)."""
    return [name for name, m in model.named_modules() if get_state(m) is not None]


def _group_params(model: nn.Module) -> dict[str, list[str]]:
    out = {}
    for name, m in model.named_modules():
        state = get_state(m)
        if state is not None and state.group is not None:
            prefix = f"{name}." if name else ""  # a group names its parameters relative to its module
            out[name] = sorted(prefix + p.fqn for p in state.group.params)
    return out


# ---- argument checks (no process group needed: they run before anything else) -------------
def _untouched(model: nn.Module) -> bool:
    return not _groups(model) and not any(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.parametrize("call, error, match", [
    (lambda m: fsdp2.fully_shard_auto(m), ValueError, "pass classes="),
    (lambda m: fsdp2.fully_shard_auto(m, classes=[Block], mesh_dims=1), TypeError,
     r"unexpected keyword argument\(s\) \['mesh_dims'\].*'mesh'"),
    (lambda m: fsdp2.fully_shard_auto(m, classes=[3]), TypeError, "nn.Module subclasses or their names"),
    (lambda m: fsdp2.fully_shard_auto(m, classes=[int]), TypeError, "nn.Module subclasses"),
    (lambda m: fsdp2.fully_shard_auto(m, classes=5), TypeError, "a module class, a class name, or an iterable"),
    (lambda m: fsdp2.fully_shard_auto(m, classes=["Blok"]), ValueError,
     r"no submodule matches classes \['Blok'\]; the model's classes are .*'Block'"),
    (lambda m: fsdp2.fully_shard_auto(m, classes=[Block, nn.Conv1d]), ValueError, r"matches classes \['Conv1d'\]"),
    (lambda m: fsdp2.fully_shard_auto(m, predicate="layers"), TypeError, "predicate must be callable"),
    (lambda m: fsdp2.fully_shard_auto(m, predicate=lambda n, mod: n), TypeError,
     r"predicate\('tok_emb', Embedding\) returned 'tok_emb'; it must return True or False"),
    (lambda m: fsdp2.fully_shard_auto([m], classes=[Block]), TypeError, "module must be an nn.Module"),
])
def test_bad_arguments_are_refused_before_anything_changes(call, error, match):
    model = Transformer()
    with pytest.raises(error, match=match):
        call(model)
    assert _untouched(model)


def _refused_in_a_late_group() -> dict:
    """A problem only the root's fully_shard would see (a scalar parameter): without the dry run
    the blocks would already be sharded when it raises."""
    model = Transformer()
    model.scale = nn.Parameter(torch.tensor(1.0))
    errors = {}
    try:
        fsdp2.fully_shard_auto(model, classes=[Block], mesh=_mesh())
    except ValueError as e:
        errors["scalar"] = str(e)
    errors["scalar_untouched"] = _untouched(model)

    model = Transformer()
    fsdp2.fully_shard(model.layers[1], mesh=_mesh())
    try:
        fsdp2.fully_shard_auto(model, classes=[Block], mesh=_mesh())
    except ValueError as e:
        errors["sharded"] = str(e)
    errors["sharded_groups"] = _groups(model)

    model = Transformer()
    try:  # a bad dim only for the 1-D LayerNorm parameters, which the blocks hold first
        from torch.distributed.tensor import Shard
        fsdp2.fully_shard_auto(model, classes=[Block], mesh=_mesh(), shard_placement_fn=lambda p: Shard(1))
    except ValueError as e:
        errors["placement"] = str(e)
    errors["placement_untouched"] = _untouched(model)
    return errors


def test_a_problem_in_any_planned_group_leaves_the_model_unsharded():
    r = run_on_ranks(_refused_in_a_late_group, 2)[0]
    assert "'scale' is a scalar" in r["scalar"] and r["scalar_untouched"]
    assert "layers.1 (FSDPBlock) is already sharded" in r["sharded"]
    assert r["sharded_groups"] == ["layers.1"]
    assert "Shard(1) for 'layers.0.attn_norm.weight'" in r["placement"] and r["placement_untouched"]


# ---- which modules get groups ---------------------------------------------------------------
def _wrap_and_log(build, **kwargs) -> dict:
    with info_records(logging.getLogger("fsdp2._wrap")) as records:
        model = fsdp2.fully_shard_auto(build(), mesh=_mesh(), **kwargs)
    return {"groups": _groups(model), "params": _group_params(model), "log": [r.getMessage() for r in records],
            "fsdp": [n for n, m in model.named_modules() if isinstance(m, fsdp2.FSDPModule)]}


def _is_embedding(name, module):
    return isinstance(module, nn.Embedding)


def _selections() -> dict:
    is_block = lambda name, m: isinstance(m, Block)  # noqa: E731
    return {
        "class": _wrap_and_log(Transformer, classes=Block),
        "name": _wrap_and_log(Transformer, classes=["Block"]),
        "qualified": _wrap_and_log(Transformer, classes="tests._models.Block"),
        "with_root": _wrap_and_log(Transformer, classes=[Transformer, "Block"]),
        "predicate": _wrap_and_log(Transformer, predicate=lambda n, m: n.startswith("layers.")
                                   and n.count(".") == 1),
        "nested": _wrap_and_log(Transformer, classes=[MLP], predicate=is_block),
        "untied_embeddings": _wrap_and_log(Transformer, classes=[Block], predicate=_is_embedding),
        "tied_both": _wrap_and_log(TiedTransformer, classes=[Block, nn.Embedding],
                                   predicate=lambda n, m: n == "output"),
        "tied_one": _wrap_and_log(TiedTransformer, classes=[Block], predicate=_is_embedding),
        "in_block": _wrap_and_log(Outer, classes=[SharedInBlock, nn.Linear]),
    }


def test_selected_modules_get_their_own_groups():
    r = run_on_ranks(_selections, 2)[0]
    blocks = ["", "layers.0", "layers.1", "layers.2"]
    for way in ("class", "name", "qualified", "with_root", "predicate"):
        assert r[way]["groups"] == blocks, way
        assert r[way]["fsdp"] == blocks, way
        assert r[way]["log"] == [], way
    assert r["class"]["params"][""] == ["norm.bias", "norm.weight", "output.weight", "pos_emb.weight",
                                        "tok_emb.weight"]
    assert r["class"]["params"]["layers.0"] == [
        "layers.0.attn_norm.bias", "layers.0.attn_norm.weight", "layers.0.mlp.in_proj.bias",
        "layers.0.mlp.in_proj.weight", "layers.0.mlp.out_proj.bias", "layers.0.mlp.out_proj.weight",
        "layers.0.mlp_norm.bias", "layers.0.mlp_norm.weight", "layers.0.proj.weight", "layers.0.qkv.weight"]
    # Nested candidates: the MLP is its own group inside its block's.
    assert r["nested"]["groups"] == ["", "layers.0", "layers.0.mlp", "layers.1", "layers.1.mlp", "layers.2",
                                     "layers.2.mlp"]
    assert "layers.0.mlp.in_proj.weight" not in r["nested"]["params"]["layers.0"]
    assert r["untied_embeddings"]["groups"] == ["", "tok_emb", "pos_emb", *blocks[1:]]

    # Tied embedding and output both selected: both go to the root with their shared weight;
    # the position embedding (also an Embedding) still gets its own group.
    tied = r["tied_both"]
    assert tied["groups"] == ["", "pos_emb", *blocks[1:]]
    assert "tok_emb.weight" in tied["params"][""]
    assert sorted(tied["log"]) == [
        "fully_shard_auto: 'output' (Linear) is not sharded on its own: it shares parameter 'output.weight' "
        "with 'tok_emb' (as 'tok_emb.weight'), so that parameter goes to the group of the root",
        "fully_shard_auto: 'tok_emb' (Embedding) is not sharded on its own: it shares parameter "
        "'tok_emb.weight' with 'output' (as 'output.weight'), so that parameter goes to the group of the root",
    ]
    # Only the embedding selected: the root already reaches the weight through the output layer.
    assert r["tied_one"]["groups"] == ["", "pos_emb", *blocks[1:]]
    assert r["tied_one"]["log"] == [
        "fully_shard_auto: 'tok_emb' (Embedding) is not sharded on its own: it shares parameter "
        "'tok_emb.weight' with the root (as 'output.weight'), so that parameter goes to the group of the root"]

    # The common ancestor of the two tied linears is a candidate block: it takes them; the
    # untied linear in the block and the head keep their own groups.
    inner = r["in_block"]
    assert inner["groups"] == ["", "blocks.0", "blocks.0.c", "blocks.1", "blocks.1.c", "head"]
    assert inner["params"]["blocks.0"] == ["blocks.0.a.bias", "blocks.0.a.weight", "blocks.0.b.bias"]
    assert any("'blocks.1.b' (Linear) is not sharded on its own" in m and "group of 'blocks.1'" in m
               for m in inner["log"])


# ---- training parity ----------------------------------------------------------------------
def _shard_by_hand(fully_shard, names: list[str]):
    """``fully_shard`` each named module in order, then the root, as a user would."""
    def shard(model: nn.Module) -> nn.Module:
        mesh = _mesh()
        modules = dict(model.named_modules())
        for name in names:
            fully_shard(modules[name], mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return shard


def _train(build, shard, steps: int = 3) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model = shard(build())
    with fsdp2.record_schedule() as events:
        losses = train(model, steps)
    with torch.no_grad():
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return losses, params, events


def _parity(arch: str) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    build = {"tied": TiedTransformer, "untied": Transformer}[arch]
    kwargs = {"tied": dict(classes=[Block, nn.Embedding], predicate=lambda n, m: n == "output"),
              "untied": dict(classes=[Block], predicate=_is_embedding)}[arch]
    auto = lambda m: fsdp2.fully_shard_auto(m, mesh=_mesh(), **kwargs)  # noqa: E731
    names = {"tied": ["pos_emb", "layers.0", "layers.1", "layers.2"],
             "untied": ["tok_emb", "pos_emb", "layers.0", "layers.1", "layers.2"]}[arch]
    runs = {"auto": _train(build, auto), "fsdp2": _train(build, _shard_by_hand(fsdp2.fully_shard, names)),
            "torch": _train(build, _shard_by_hand(torch_fully_shard, names))}
    train_parity(build, auto)  # against the unsharded reference (asserts inside)
    return {
        "losses": {k: torch.stack(v[0]) for k, v in runs.items()},
        "params_equal": {k: all(torch.equal(v[1][n], runs["auto"][1][n]) for n in v[1]) for k, v in runs.items()},
        "events_equal_by_hand": runs["auto"][2] == runs["fsdp2"][2],
        "events": len(runs["auto"][2]),
    }


@pytest.mark.parametrize("arch", ["tied", "untied"])
@pytest.mark.slow
def test_training_matches_fully_shard_by_hand_and_torch(arch):
    for r in run_on_ranks(_parity, 2, arch):
        assert torch.equal(r["losses"]["auto"], r["losses"]["fsdp2"]), r["losses"]
        assert torch.equal(r["losses"]["auto"], r["losses"]["torch"]), r["losses"]
        assert r["params_equal"] == {"auto": True, "fsdp2": True, "torch": True}
        assert r["events_equal_by_hand"] and r["events"] > 0
