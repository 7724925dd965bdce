"""``fully_shard_auto`` on transformers' Llama (tied and untied) and GPT-2.

The decoder layers are chosen by class, by class name (as Accelerate's
``transformer_layer_cls_to_wrap`` names them) and by a predicate that also picks the
embeddings and the LM head: with tied weights the embedding and the head fall back to the
root's group (and a log record says so), untied they get groups of their own. Each way
trains 3 AdamW steps on 2 gloo ranks bit for bit like torch's ``fully_shard`` applied by
hand to the same modules, and within rounding like the unsharded reference.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.runtime._state import get_state
from tests._dist import info_records, run_on_ranks

pytest.importorskip("transformers")

from tests.integration import _hf  # noqa: E402  (needs transformers)

STEPS = 3
REF_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
LAYERS = {"llama": ["model.layers.0", "model.layers.1"], "gpt2": ["transformer.h.0", "transformer.h.1"]}
# The groups the embedding/head predicate gives, besides the root's and the layers'.
EXTRA = {"llama-tied": [], "llama-untied": ["model.embed_tokens", "lm_head"], "gpt2": ["transformer.wpe"]}
SKIPPED = {"llama-tied": ["lm_head", "model.embed_tokens"], "llama-untied": [], "gpt2": ["lm_head", "transformer.wte"]}


def _selection(model: nn.Module, way: str) -> dict:
    layer_cls = type(_hf.layers(model)[0])
    if way == "class":
        return {"classes": [layer_cls]}
    if way == "name":
        return {"classes": layer_cls.__name__}
    head = model.get_output_embeddings()
    return {"predicate": lambda name, m: isinstance(m, (layer_cls, nn.Embedding)) or m is head}


def _auto(model: nn.Module, way: str) -> list[str]:
    """Shard with fully_shard_auto; the INFO messages it logged."""
    with info_records(logging.getLogger("fsdp2._wrap")) as records:
        fsdp2.fully_shard_auto(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                               **_selection(model, way))
    return [r.getMessage() for r in records]


def _train(arch: str, way: str) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    base = _hf.build(arch)
    ours = copy.deepcopy(base)
    messages = _auto(ours, way)
    groups = [name for name, m in ours.named_modules() if get_state(m) is not None]
    # torch's fully_shard by hand on the same modules, innermost first (named_modules is
    # pre-order, so reversed puts children before parents), then the root.
    theirs = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    modules = dict(theirs.named_modules())
    for name in reversed(groups[1:]):
        torch_fully_shard(modules[name], mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)

    losses, ref = _hf.train_beside_reference({"fsdp2": ours, "torch": theirs}, base, STEPS)
    mine, torchs, reference = (_hf.full_params(m) for m in (ours, theirs, ref.master))
    init = _hf.full_params(_hf.build(arch))
    return {
        "groups": groups,
        "messages": messages,
        "losses": {k: torch.stack(v) for k, v in losses.items()},
        "torch_param_diff": _hf.first_difference(mine, torchs),
        "ref_param_diff": max((mine[n] - reference[n]).abs().max().item() for n in reference),
        "least_moved": min((mine[n] - init[n]).abs().max().item() for n in init),
        "tied": ours.get_output_embeddings().weight is ours.get_input_embeddings().weight,
    }


@pytest.mark.parametrize("way", ["class", "name", "predicate"])
@pytest.mark.parametrize("arch", _hf.ARCHS)
def test_auto_wrap_trains_like_torch_by_hand_and_reference(arch, way):
    results = run_on_ranks(_train, 2, arch, way)
    layers = LAYERS[arch.split("-")[0]]
    extra = EXTRA[arch] if way == "predicate" else []
    skipped = SKIPPED[arch] if way == "predicate" else []
    for r in results:
        assert sorted(r["groups"]) == sorted(["", *layers, *extra]), r["groups"]
        assert sorted(m.split("'")[1] for m in r["messages"]) == skipped, r["messages"]
        assert all("goes to the group of the root" in m for m in r["messages"])
        assert torch.equal(r["losses"]["fsdp2"], r["losses"]["torch"]), r["losses"]
        assert r["torch_param_diff"] is None, r["torch_param_diff"]
        torch.testing.assert_close(r["losses"]["fsdp2"], r["losses"]["ref"], **REF_TOLERANCE)
        assert r["ref_param_diff"] <= REF_TOLERANCE["atol"], r["ref_param_diff"]
        assert r["least_moved"] > 1e-3, "every parameter trains"
        assert r["tied"] == (arch != "llama-untied")
