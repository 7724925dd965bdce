"""QLoRA with torchao's NF4 weights: frozen 4-bit base weights, trainable LoRA adapters.

torchao's ``NF4Tensor`` (``to_nf4``) defines the all-gather extension with the older
one-argument ``fsdp_pre_all_gather(self, mesh)``: FSDP gathers its packed 4-bit data, block
scalers and quantization factors, and ``fsdp_post_all_gather`` rebuilds the NF4 tensor around
them (checking, on later gathers, that ``out``'s data is the all-gather output). fsdp2 trains
such a model on CPU like torch's ``fully_shard`` and like an unsharded reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from tests._dist import environ, run_on_ranks
from tests._parity import average_grads, full

pytest.importorskip("torchao")

DIM = 256  # NF4: 64-value blocks, 256-block scaler groups; each rank needs whole groups (256 x 256 = 4 groups)


class QLoRALinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torchao.quantization import to_nf4

        self.weight = nn.Parameter(to_nf4(torch.randn(DIM, DIM) / DIM ** 0.5), requires_grad=False)
        self.lora_A = nn.Linear(DIM, 8, bias=False)
        self.lora_B = nn.Linear(8, DIM, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, DIM); torchao routes F.linear on an NF4 weight to its dequantizing linear
        return nn.functional.linear(x, self.weight) + self.lora_B(self.lora_A(x))


class QLoRANet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([QLoRALinear(), QLoRALinear()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _build() -> nn.Module:
    torch.manual_seed(0)
    return QLoRANet()


def _shard(model: nn.Module, fully_shard) -> nn.Module:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _train(transport: str) -> list[str]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchao.quantization import NF4Tensor

    with environ(CPU_COLLECTIVES_ENV, transport):
        models = {"ref": _build(), "fsdp2": _shard(_build(), fsdp2.fully_shard),
                  "torch": _shard(_build(), torch_fully_shard)}
    opts = {n: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for n, m in models.items()}
    seen = []
    models["fsdp2"].blocks[1].register_forward_pre_hook(lambda m, _a: seen.append(type(m.weight).__name__))
    for step in range(3):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        losses = {}
        for name, model in models.items():
            losses[name] = model(x).square().mean()
            losses[name].backward()
        average_grads(models["ref"])
        named = {n: dict(m.named_parameters()) for n, m in models.items()}
        for pname, ref in named["ref"].items():
            if ref.grad is None:
                assert named["fsdp2"][pname].grad is None and named["torch"][pname].grad is None, pname
                continue
            for other in ("fsdp2", "torch"):
                torch.testing.assert_close(full(named[other][pname].grad), ref.grad, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"step {step} {other} {pname}: {m}")
            torch.testing.assert_close(full(named["fsdp2"][pname].grad), full(named["torch"][pname].grad),
                                       atol=0, rtol=0)
        for opt in opts.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        for other in ("fsdp2", "torch"):
            torch.testing.assert_close(losses[other], losses["ref"], atol=1e-5, rtol=1e-5)
    assert isinstance(models["fsdp2"].blocks[0].weight.to_local(), NF4Tensor)
    state = models["fsdp2"].state_dict()  # the DTensor's local tensor is the NF4 shard, as with torch
    assert isinstance(state["blocks.0.weight"].to_local(), NF4Tensor)
    return seen


@pytest.mark.parametrize("transport", ["flat", "exchange", "read"])
def test_qlora_nf4_trains_like_torch_and_the_reference(transport):
    seen = run_on_ranks(_train, 2, transport)
    assert seen[0] == ["NF4Tensor"] * 3
