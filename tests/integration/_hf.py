"""Tiny transformers models with random weights, sharded per decoder layer then at the root.

Shared by the integration tests: build a model from a config (nothing is downloaded), shard
it with fsdp2's or torch's ``fully_shard``, make the ranks' batches, and train an unsharded
reference the way data parallelism must (gradients averaged over the ranks, and under
mixed precision the same casts ``MixedPrecisionPolicy`` makes). Import it only after
``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2

VOCAB = 96  # splits evenly over 2 ranks; the tied embedding/output share one (96, 32) parameter
SEQ = 12
ARCHS = ("llama-tied", "llama-untied", "gpt2")
BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def build(arch: str, *, seed: int = 0) -> nn.Module:
    """A 2-layer, 32-wide causal LM in train mode with no dropout, the same on every rank."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if arch.startswith("llama"):
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=arch == "llama-tied", pad_token_id=0, eos_token_id=None,
                             bos_token_id=None)
        cls: Any = LlamaForCausalLM
    elif arch == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
                            eos_token_id=None, bos_token_id=None)
        cls = GPT2LMHeadModel
    else:
        raise ValueError(f"unknown arch {arch!r}; pick one of {ARCHS}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.train()


def layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers, whatever the architecture names them."""
    inner = getattr(model, "model", None) or model.transformer
    return inner.layers if hasattr(inner, "layers") else inner.h


def enable_checkpointing(model: nn.Module, use_reentrant: bool) -> None:
    """HF's own activation checkpointing of every decoder layer."""
    with warnings.catch_warnings():  # transformers 5 renamed it activation_checkpointing_enable
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


def shard(model: nn.Module, impl: str, mp: dict | None = None) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root, with ``impl`` "fsdp2" or "torch"."""
    if impl == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        MixedPrecisionPolicy, fully_shard = fsdp2.MixedPrecisionPolicy, fsdp2.fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(**(mp or {}))
    for layer in layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def batch(step: int, rank: int | None = None) -> torch.Tensor:
    """(2, SEQ) token ids, different for every (rank, step); the labels are the ids themselves."""
    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randint(1, VOCAB, (2, SEQ), generator=g)


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    tokens = batch(step)
    return model(input_ids=tokens, labels=tokens).loss


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    loss = loss_of(model, step)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def full(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(p) for name, p in model.named_parameters()}


def first_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str | None:
    """The first name whose tensors are not bit-identical, with the largest difference; None if all are."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for name in a:
        if not torch.equal(a[name], b[name]):
            return f"{name}: max |diff| {(a[name].float() - b[name].float()).abs().max().item():.3g}"
    return None


class Reference:
    """An unsharded model trained as data parallelism must: gradients averaged over the ranks.

    With ``mp`` (bf16 parameters, fp32 reduction) it keeps fp32 master weights and runs forward
    and backward on a copy whose parameters (not buffers: RoPE's ``inv_freq`` stays fp32) are
    the masters cast to bf16, as ``MixedPrecisionPolicy`` does; the bf16 gradients are cast to
    fp32 before they are averaged.
    """

    def __init__(self, model: nn.Module, mp: dict | None = None, lr: float = 1e-2) -> None:
        self.master = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.param_dtype = (mp or {}).get("param_dtype")
        self.compute = copy.deepcopy(model) if self.param_dtype else model

    def step(self, step: int) -> torch.Tensor:
        pairs = list(zip(self.master.parameters(), self.compute.parameters()))
        if self.param_dtype:
            for p, c in pairs:
                c.data = p.detach().to(self.param_dtype)
        loss = loss_of(self.compute, step)
        loss.backward()
        for p, c in pairs:
            grad, c.grad = c.grad.float(), None  # c may be p itself (no mixed precision)
            dist.all_reduce(grad)
            p.grad = grad / dist.get_world_size()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()


def train_three_ways(build_model: Callable[[], nn.Module], mp: dict | None, steps: int,
                     prepare: Callable[[nn.Module], None] = lambda m: None) -> dict[str, Any]:
    """Train fsdp2, torch's ``fully_shard`` and the unsharded reference from one initial model.

    ``prepare`` runs on the initial model before it is copied and sharded (e.g. to enable
    activation checkpointing). Returns ``{"models": {"fsdp2": ..., "torch": ...}, "losses":
    {"fsdp2" | "torch" | "ref": [loss per step]}, "ref": the reference model}``.
    """
    base = build_model()
    prepare(base)
    models = {impl: shard(copy.deepcopy(base), impl, mp) for impl in ("fsdp2", "torch")}
    losses, ref = train_beside_reference(models, base, steps, mp)
    return {"models": models, "losses": losses, "ref": ref.master}


def train_beside_reference(models: dict[str, nn.Module], base: nn.Module, steps: int,
                           mp: dict | None = None) -> tuple[dict[str, list[torch.Tensor]], Reference]:
    """``steps`` AdamW steps of each sharded model and of the unsharded :class:`Reference` of
    ``base``, interleaved; the losses per model (``"ref"`` for the reference) and the reference."""
    opts = {impl: torch.optim.AdamW(m.parameters(), lr=1e-2) for impl, m in models.items()}
    ref = Reference(base, mp)
    losses: dict[str, list[torch.Tensor]] = {impl: [] for impl in (*models, "ref")}
    for step in range(steps):
        for impl, model in models.items():
            losses[impl].append(train_step(model, opts[impl], step))
        losses["ref"].append(ref.step(step))
    return losses, ref
