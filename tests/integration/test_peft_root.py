"""PEFT LoRA with the root ``fully_shard`` on the ``PeftModel`` or on the model it wraps.

``get_peft_model`` wraps a tiny random Llama: ``PeftModel`` -> ``LoraModel`` -> ``LlamaForCausalLM``,
with every base weight frozen and ``lora_A``/``lora_B`` trainable on ``q_proj`` and ``v_proj``.
The decoder layers are sharded first; the root call goes to the outermost ``PeftModel`` (what
a training script holds) or to the inner ``LlamaForCausalLM`` (what sharding code that only
knows the transformers model reaches), and training always goes through the ``PeftModel``.
Either way fsdp2 trains like torch's ``fully_shard`` with the same root, bit for bit, and
the two roots give the same result. (tests/integration/test_peft_lora.py covers LoRA
against an unsharded reference.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from tests._dist import run_on_ranks

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.integration import _hf  # noqa: E402  (needs transformers)

STEPS = 2


def _lora(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(_hf.build("llama-untied"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        for name, p in model.named_parameters():  # PEFT zeroes lora_B; start off zero so lora_A trains too
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    return model


def _shard(model, impl: str, root: str):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    fully_shard = torch_fully_shard if impl == "torch" else fsdp2.fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    inner = model.get_base_model()  # the LlamaForCausalLM
    for layer in _hf.layers(inner):
        fully_shard(layer, mesh=mesh)
    fully_shard(model if root == "peft" else inner, mesh=mesh)
    return model


def _train_roots() -> dict:
    base = _lora()
    runs = {}
    for impl in ("fsdp2", "torch"):
        for root in ("peft", "inner"):
            model = _shard(copy.deepcopy(base), impl, root)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            losses = torch.stack([_hf.train_step(model, opt, step) for step in range(STEPS)])
            runs[impl, root] = (losses, _hf.full_params(model))
    init = _hf.full_params(base)
    trained = {n for n, p in runs["fsdp2", "peft"][1].items() if not torch.equal(p, init[n])}
    return {
        "torch_diff": {root: _hf.first_difference(runs["fsdp2", root][1], runs["torch", root][1])
                       for root in ("peft", "inner")},
        "torch_losses_equal": {root: torch.equal(runs["fsdp2", root][0], runs["torch", root][0])
                               for root in ("peft", "inner")},
        "roots_diff": _hf.first_difference(runs["fsdp2", "peft"][1], runs["fsdp2", "inner"][1]),
        "trained": sorted(n.split(".layers.")[-1] for n in trained),
    }


def test_lora_root_peft_model_or_inner_model_matches_torch():
    for r in run_on_ranks(_train_roots, 2):
        assert r["torch_diff"] == {"peft": None, "inner": None}, r["torch_diff"]
        assert r["torch_losses_equal"] == {"peft": True, "inner": True}
        assert r["roots_diff"] is None, r["roots_diff"]
        # Only the adapters train: 2 layers x (q_proj, v_proj) x (lora_A, lora_B).
        assert r["trained"] == sorted(f"{i}.self_attn.{proj}.{ab}.default.weight"
                                      for i in range(2) for proj in ("q_proj", "v_proj")
                                      for ab in ("lora_A", "lora_B")), r["trained"]
