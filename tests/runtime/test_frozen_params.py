"""Frozen parameters: LoRA adapters on frozen weights, and ``requires_grad`` changed after ``fully_shard``.

A frozen parameter gets no gradient, so nothing but its module's inputs' gradients says when
backward is done with it: a LoRA base weight computes its input's gradient after the
adapters' gradients are in. Its group must stay gathered until then (it used to free the
weight first, and backward failed on an empty storage). ``requires_grad`` is read at every
forward, so freezing or unfreezing a sharded parameter between steps takes effect: no
gradient, no reduce-scatter, no optimizer update for a frozen one. Each case trains fsdp2,
torch's ``fully_shard`` and an unsharded reference (gradients averaged over the ranks) side by
side with AdamW and compares losses, gradients and parameters at every step.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from tests._dist import environ, run_on_ranks
from tests._parity import full

DIM, VOCAB = 64, 32


class LoRALinear(nn.Module):
    """A frozen ``base_layer`` plus a trainable low-rank update ``lora_B(lora_A(x))``."""

    def __init__(self, dim_in: int, dim_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base_layer = nn.Linear(dim_in, dim_out)
        self.lora_A = nn.Linear(dim_in, rank, bias=False)
        self.lora_B = nn.Linear(rank, dim_out, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)  # not zero: the first step moves lora_A too
        self.base_layer.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


class LoRABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = LoRALinear(DIM, DIM)
        self.mlp = nn.Linear(DIM, DIM)
        self.mlp.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, seq, dim)
        return x + torch.tanh(self.mlp(self.attn(x)))


class LoRAModel(nn.Module):
    """Frozen embedding and head around LoRA blocks: the first block's input needs no gradient."""

    def __init__(self, n_layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(LoRABlock() for _ in range(n_layers))
        self.head = nn.Linear(DIM, VOCAB)
        self.emb.requires_grad_(False)
        self.head.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Plain(nn.Module):
    """Three trainable blocks, each ``fully_shard``-ed, for freezing after the fact."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
                                    for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _shard(model: nn.Module, fully_shard) -> nn.Module:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_three_ways(build: Callable[[], nn.Module], steps: int, before_step=None, after_forward=None,
                     with_torch: bool = True) -> list[str]:
    """Train fsdp2, torch's FSDP2 and the unsharded reference; compare at every step.

    ``before_step(step, model)`` may freeze or unfreeze parameters (by name, on every model),
    ``after_forward(step, model)`` too, between forward and backward. ``with_torch=False``
    leaves torch's FSDP2 out (where it does not follow the reference).
    Returns, per step, the names of the parameters that had a gradient.
    """
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = build()
    models = {"ref": ref, "fsdp2": _shard(copy.deepcopy(ref), fsdp2.fully_shard)}
    if with_torch:
        models["torch"] = _shard(copy.deepcopy(ref), torch_fully_shard)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-2) for name, m in models.items()}
    with_grads = []
    for step in range(steps):
        inputs, targets = _batch(rank, step)
        losses = {}
        for name, model in models.items():
            if before_step is not None:
                before_step(step, model)
            loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            if after_forward is not None:
                after_forward(step, model)
            loss.backward()
            losses[name] = loss.detach()
        for p in ref.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        _compare(models, step)
        with_grads.append(" ".join(n for n, p in ref.named_parameters() if p.grad is not None))
        for opt in opts.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(losses["fsdp2"], losses["ref"], msg=lambda m: f"step {step} loss: {m}")
        if with_torch:
            torch.testing.assert_close(losses["fsdp2"], losses["torch"], msg=lambda m: f"step {step} loss: {m}")
    _compare(models, steps)
    return with_grads


def _compare(models: dict[str, nn.Module], step: int) -> None:
    """Same parameters everywhere; the same gradients, and None in the same places; fsdp2's
    flags as the reference's (torch's keep the root's sharded flags: see train_three_ways)."""
    named = {name: dict(m.named_parameters()) for name, m in models.items()}
    for pname, p_ref in named["ref"].items():
        assert named["fsdp2"][pname].requires_grad == p_ref.requires_grad, (step, pname)
        for other in named.keys() - {"ref"}:
            p = named[other][pname]
            torch.testing.assert_close(full(p.detach()), p_ref.detach(), atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"step {step} {other} {pname}: {m}")
            if p_ref.grad is None or p.grad is None:
                assert p_ref.grad is None and p.grad is None, (step, other, pname, p_ref.grad is None)
            else:
                torch.testing.assert_close(full(p.grad), p_ref.grad, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"step {step} {other} {pname} grad: {m}")


def _lora(transport: str) -> list[str]:
    with environ(CPU_COLLECTIVES_ENV, transport):
        return train_three_ways(LoRAModel, steps=3)


@pytest.mark.parametrize("transport", ["flat", "exchange"])
def test_lora_on_frozen_weights_trains_like_torch_and_the_reference(transport):
    with_grads = run_on_ranks(_lora, 2, transport)
    adapters = " ".join(f"blocks.{i}.attn.lora_{m}.weight" for i in range(3) for m in "AB")
    assert with_grads[0] == with_grads[1] == [adapters] * 3


def _frozen_block_0(step: int, model: nn.Module) -> None:
    if step == 0:  # after fully_shard, before the first step (and before lazy init)
        model.blocks[0].requires_grad_(False)


def _freeze_after_fully_shard() -> list[str]:
    return train_three_ways(Plain, steps=2, before_step=_frozen_block_0)


def test_freezing_after_fully_shard_before_the_first_step():
    with_grads = run_on_ranks(_freeze_after_fully_shard, 2)
    assert all("blocks.0." not in names and "blocks.1.0.weight" in names for names in with_grads[0])


def _toggle(step: int, model: nn.Module) -> None:
    """Step 1 freezes block 1 and the head's bias; step 2 unfreezes block 1; step 3 freezes all
    but block 2's first layer (groups both mixed and whole-frozen); step 4 unfreezes everything."""
    named = dict(model.named_parameters())
    if step == 1:
        model.blocks[1].requires_grad_(False)
        named["head.bias"].requires_grad_(False)
    elif step == 2:
        model.blocks[1].requires_grad_(True)
    elif step == 3:
        model.requires_grad_(False)
        model.blocks[2][0].requires_grad_(True)
    elif step == 4:
        model.requires_grad_(True)


def _freeze_and_unfreeze() -> list[str]:
    return train_three_ways(Plain, steps=5, before_step=_toggle)


def test_freezing_and_unfreezing_between_steps():
    with_grads = run_on_ranks(_freeze_and_unfreeze, 2)[0]
    assert "blocks.1.0.weight" not in with_grads[1] and "head.bias" not in with_grads[1]
    assert "blocks.1.0.weight" in with_grads[2] and "head.bias" not in with_grads[2]
    assert with_grads[3] == "blocks.2.0.weight blocks.2.0.bias"
    assert with_grads[4] == with_grads[0]


def _unfrozen_lora_base(step: int, model: nn.Module) -> None:
    if step == 1:  # a parameter frozen at fully_shard time gets its gradients from now on
        model.blocks[1].attn.base_layer.requires_grad_(True)
        model.head.weight.requires_grad_(True)


def _unfreeze_frozen_at_fully_shard() -> list[str]:
    return train_three_ways(LoRAModel, steps=3, before_step=_unfrozen_lora_base)


def test_unfreezing_a_parameter_frozen_at_fully_shard():
    with_grads = run_on_ranks(_unfreeze_frozen_at_fully_shard, 2)[0]
    assert "blocks.1.attn.base_layer.weight" not in with_grads[0]
    assert "blocks.1.attn.base_layer.weight" in with_grads[1] and "head.weight" in with_grads[2]


def _toggle_mid_step(step: int, model: nn.Module) -> None:
    """Between forward and backward, where the root's parameters are the unsharded ones: step 1
    freezes everything, step 3 the head and block 1, step 5 unfreezes block 0 (frozen at its
    forward, so no gradient before step 6)."""
    if step == 1:
        model.requires_grad_(False)
    elif step == 3:
        model.head.requires_grad_(False)
        model.blocks[1].requires_grad_(False)
    elif step == 5:
        model.blocks[0].requires_grad_(True)


def _unfreeze_before_step(step: int, model: nn.Module) -> None:
    if step in (2, 4):  # what the step before froze between its forward and backward trains again
        model.requires_grad_(True)
    elif step == 5:
        model.blocks[0].requires_grad_(False)


def _toggled_between_forward_and_backward() -> list[str]:
    return train_three_ways(Plain, steps=7, before_step=_unfreeze_before_step, after_forward=_toggle_mid_step)


def test_requires_grad_toggled_between_forward_and_backward_is_honoured_from_then_on():
    # The root's flags used to land on its unsharded parameters only: unfreezing later never
    # reached them, and the embedding and head silently stopped training.
    with_grads = run_on_ranks(_toggled_between_forward_and_backward, 2)[0]
    everything = with_grads[0]
    assert with_grads[1] == "" and with_grads[2] == everything
    assert "head.weight" not in with_grads[3] and "blocks.1.0.weight" not in with_grads[3]
    assert "emb.weight" in with_grads[3] and with_grads[4] == everything
    assert "blocks.0.0.weight" not in with_grads[5] and with_grads[6] == everything


def _freeze_head_mid_step(step: int, model: nn.Module) -> None:
    if step == 1:
        model.head.requires_grad_(False)


def _frozen_between_forward_and_backward_stays_frozen() -> list[str]:
    # torch's FSDP2 takes the root's flags from its sharded parameters at every unshard, so a
    # freeze of the head's unsharded parameters lasts one backward there (docs/comparison.md).
    return train_three_ways(Plain, steps=4, after_forward=_freeze_head_mid_step, with_torch=False)


def test_requires_grad_frozen_between_forward_and_backward_stays_frozen_like_the_reference():
    with_grads = run_on_ranks(_frozen_between_forward_and_backward_stays_frozen, 2)[0]
    assert "head.weight" in with_grads[0]
    assert all("head." not in names and "emb.weight" in names for names in with_grads[1:])


def _trainable_lora() -> nn.Module:
    return LoRAModel().requires_grad_(True)


def _freeze_bases_mid_step(step: int, model: nn.Module) -> None:
    if step == 1:  # the adapters' gradients come before the base weights' last use in backward
        for block in model.blocks:
            block.attn.base_layer.requires_grad_(False)


def _lora_bases_frozen_mid_step() -> list[str]:
    return train_three_ways(_trainable_lora, steps=3, after_forward=_freeze_bases_mid_step)


def test_weights_frozen_between_forward_and_backward_stay_gathered_while_backward_reads_them():
    with_grads = run_on_ranks(_lora_bases_frozen_mid_step, 2)[0]
    assert "blocks.0.attn.base_layer.weight" in with_grads[0]
    assert all("base_layer" not in names and "blocks.0.attn.lora_A.weight" in names for names in with_grads[1:])


def _no_reduce_scatter_for_frozen_groups() -> list[str]:
    torch.manual_seed(0)
    model = _shard(Plain(), fsdp2.fully_shard)
    model.requires_grad_(False)
    model.blocks[1].requires_grad_(True)
    with fsdp2.record_schedule() as events:
        model(_batch(dist.get_rank(), 0)[0]).sum().backward()
    return [e for e in events if e.startswith("reduce_scatter")]


def test_groups_with_only_frozen_parameters_do_not_reduce():
    assert run_on_ranks(_no_reduce_scatter_for_frozen_groups, 2) == [["reduce_scatter blocks.1"]] * 2
