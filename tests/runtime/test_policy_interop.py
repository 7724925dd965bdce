"""fsdp2's fully_shard takes torch's policy objects: same numbers as fsdp2's own policies.

torch's ``MixedPrecisionPolicy``, ``OffloadPolicy`` and ``CPUOffloadPolicy`` are converted
to fsdp2's field by field (and checked like them); an object that is no policy still gets
a TypeError naming the fix, with the module left unsharded.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy

import fsdp2
from fsdp2._api import as_mixed_precision_policy, as_offload_policy
from fsdp2.runtime._state import get_state
from tests._dist import run_on_ranks
from tests._models import MLP, Transformer, train
from tests._parity import full


def _train(base: nn.Module, **policies) -> tuple[list[torch.Tensor], list[torch.Tensor], nn.Module]:
    model = copy.deepcopy(base)
    for block in model.layers:
        fsdp2.fully_shard(block, **policies)
    fsdp2.fully_shard(model, **policies)
    losses = train(model, 2)
    return losses, [full(p).detach() for p in model.parameters()], model


def _torch_policies_match_ours() -> None:
    base = Transformer(n_layers=2, dim=32, n_heads=4)
    mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    theirs = _train(base, mp_policy=TorchMixedPrecisionPolicy(**mp), offload_policy=TorchCPUOffloadPolicy())
    ours = _train(base, mp_policy=fsdp2.MixedPrecisionPolicy(**mp), offload_policy=fsdp2.CPUOffloadPolicy())
    fp32 = _train(base, offload_policy=TorchOffloadPolicy())
    for got, want in zip(theirs[0] + theirs[1], ours[0] + ours[1]):
        assert torch.equal(got, want)
    assert not torch.equal(theirs[0][0], fp32[0][0]), "bf16 must have changed the loss"
    state = get_state(theirs[2].layers[0])
    assert state.mp_policy == fsdp2.MixedPrecisionPolicy(**mp)
    assert all(p.offload_to_cpu for p in state.group.params)
    assert not any(p.offload_to_cpu for p in get_state(fp32[2].layers[0]).group.params)


def test_torch_policies_give_the_same_numbers():
    run_on_ranks(_torch_policies_match_ours, 2)


def test_every_field_is_converted():
    for fields in (dict(param_dtype=torch.bfloat16, reduce_dtype=None, output_dtype=torch.float32,
                        cast_forward_inputs=False),
                   dict(param_dtype=None, reduce_dtype=torch.float16, output_dtype=None, cast_forward_inputs=True)):
        converted = as_mixed_precision_policy(TorchMixedPrecisionPolicy(**fields))
        assert type(converted) is fsdp2.MixedPrecisionPolicy and converted == fsdp2.MixedPrecisionPolicy(**fields)
    assert as_offload_policy(TorchCPUOffloadPolicy(pin_memory=False)) == fsdp2.CPUOffloadPolicy(pin_memory=False)
    assert type(as_offload_policy(TorchOffloadPolicy())) is fsdp2.OffloadPolicy


def _wrong_policies_are_refused() -> None:
    model = MLP(8)
    with pytest.raises(TypeError, match=r"mp_policy must be a MixedPrecisionPolicy, got dict .*"
                                        r"fsdp2.MixedPrecisionPolicy\(param_dtype="):
        fsdp2.fully_shard(model, mp_policy={"param_dtype": torch.bfloat16})
    with pytest.raises(TypeError, match=r"offload_policy must be an OffloadPolicy, got str .*"
                                        r"fsdp2.CPUOffloadPolicy\(pin_memory="):
        fsdp2.fully_shard(model, offload_policy="cpu")
    # torch's classes do not check their fields; converted, they are checked as fsdp2's are.
    with pytest.raises(ValueError, match="param_dtype must be a floating-point dtype, got torch.int32"):
        fsdp2.fully_shard(model, mp_policy=TorchMixedPrecisionPolicy(param_dtype=torch.int32))
    with pytest.raises(TypeError, match="pin_memory must be a bool"):
        fsdp2.fully_shard(model, offload_policy=TorchCPUOffloadPolicy(pin_memory="yes"))
    assert not isinstance(model, fsdp2.FSDPModule) and get_state(model) is None
    assert not any(hasattr(m, "_is_fsdp_managed_module") for m in model.modules())


def test_wrong_policies_are_refused_with_the_fix():
    run_on_ranks(_wrong_policies_are_refused, 2)
