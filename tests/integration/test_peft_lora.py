"""PEFT LoRA on transformers' Llama: frozen base weights next to trainable adapters in each group.

``get_peft_model`` freezes every weight of a tiny random ``LlamaForCausalLM`` but the
``lora_A``/``lora_B`` adapters of ``q_proj`` and ``v_proj``. fsdp2 trains it like an
unsharded reference (gradients averaged over the ranks) and like torch's ``fully_shard``.
Nothing is downloaded.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fsdp2
from tests._dist import run_on_ranks
from tests._parity import full

pytest.importorskip("peft")
pytest.importorskip("transformers")

VOCAB = 128


def _build():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():  # PEFT zeroes lora_B: start off zero so lora_A learns too
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _shard(model, fully_shard):
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _train() -> list[str]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    ref = _build()
    models = {"ref": ref, "fsdp2": _shard(copy.deepcopy(ref), fsdp2.fully_shard),
              "torch": _shard(copy.deepcopy(ref), torch_fully_shard)}
    opts = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for name, m in models.items()}
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))
        losses = {}
        for name, model in models.items():
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            losses[name] = loss.detach()
        for p in ref.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        for opt in opts.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(losses["fsdp2"], losses["ref"], msg=lambda m: f"step {step} loss: {m}")
        torch.testing.assert_close(losses["fsdp2"], losses["torch"], msg=lambda m: f"step {step} loss: {m}")
    trained = []
    named = {name: dict(m.named_parameters()) for name, m in models.items()}
    for pname, p_ref in named["ref"].items():
        for other in ("fsdp2", "torch"):
            torch.testing.assert_close(full(named[other][pname].detach()), p_ref.detach(), atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{other} {pname}: {m}")
        if p_ref.requires_grad:
            trained.append(pname.split(".layers.")[1])
    return trained


def test_peft_lora_llama_trains_like_torch_and_the_reference():
    trained = run_on_ranks(_train, 2, timeout=300)
    assert trained[0] == trained[1] == [f"{i}.self_attn.{proj}.lora_{m}.default.weight"
                                        for i in range(2) for proj in ("q_proj", "v_proj") for m in "AB"]
