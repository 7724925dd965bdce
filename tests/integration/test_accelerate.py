"""Accelerate's FSDP2 path, unmodified, on fsdp2 through ``fsdp2.patch_torch()``.

``accelerate.utils.fsdp_utils.fsdp2_prepare_model`` (what ``Accelerator.prepare`` runs for
``FullyShardedDataParallelPlugin(fsdp_version=2)``) shards a transformers Llama / GPT-2 with
its own auto-wrap policy (``transformer_cls_names_to_wrap``), its embedding and
[final norm, lm_head] groups and its ``isinstance(m, FSDPModule)`` checks. Inside the patch
every one of those calls is fsdp2's; the model trains 3 AdamW steps on 2 gloo ranks bit for
bit like the same function run on torch's FSDP2, and like the unsharded reference.

A real ``Accelerator`` cannot be used here: on CPU it is ``MULTI_CPU`` and Accelerate keeps
FSDP for GPU-like devices (it falls back to DDP). So the test hands ``fsdp2_prepare_model``
an object with the attributes of an ``Accelerator`` that it reads (the plugin, no device
mesh, no mixed precision, the CPU device).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import fsdp2
from fsdp2.runtime._state import get_state
from tests._dist import run_on_ranks

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tests.integration import _hf  # noqa: E402  (needs transformers)

STEPS = 3
REF_TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def _prepare(model, layer_class: str):
    """Accelerate's FSDP2 preparation, with the plugin an Accelerator would hold."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=[layer_class])
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                  parallelism_config=None, mixed_precision="no",
                                  is_main_process=dist.get_rank() == 0, device=torch.device("cpu"))
    return fsdp2_prepare_model(accelerator, model)


def _train(arch: str) -> dict:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    base = _hf.build(arch)
    layer_class = type(_hf.layers(base)[0]).__name__
    theirs = _prepare(copy.deepcopy(base), layer_class)
    with fsdp2.patch_torch():  # the plugin (and its OffloadPolicy) is built inside: fsdp2's
        ours = _prepare(copy.deepcopy(base), layer_class)
    losses, ref = _hf.train_beside_reference({"fsdp2": ours, "torch": theirs}, base, STEPS)
    mine, torchs, reference = (_hf.full_params(m) for m in (ours, theirs, ref.master))
    return {
        "ours": sorted(n for n, m in ours.named_modules() if isinstance(m, fsdp2.FSDPModule)),
        "theirs": sorted(n for n, m in theirs.named_modules() if isinstance(m, TorchFSDPModule)),
        "groups": len({id(get_state(m)) for m in ours.modules() if get_state(m) is not None}),
        "torch_in_ours": any(isinstance(m, TorchFSDPModule) for m in ours.modules()),
        "losses": {k: torch.stack(v) for k, v in losses.items()},
        "torch_param_diff": _hf.first_difference(mine, torchs),
        "ref_param_diff": max((mine[n] - reference[n]).abs().max().item() for n in reference),
    }


@pytest.mark.parametrize("arch", _hf.ARCHS)
def test_fsdp2_prepare_model_on_fsdp2_matches_torch_and_reference(arch):
    for r in run_on_ranks(_train, 2, arch):
        assert r["ours"] == r["theirs"] and len(r["ours"]) >= 5, (r["ours"], r["theirs"])
        assert not r["torch_in_ours"]
        assert torch.equal(r["losses"]["fsdp2"], r["losses"]["torch"]), r["losses"]
        assert r["torch_param_diff"] is None, r["torch_param_diff"]
        torch.testing.assert_close(r["losses"]["fsdp2"], r["losses"]["ref"], **REF_TOLERANCE)
        assert r["ref_param_diff"] <= REF_TOLERANCE["atol"], r["ref_param_diff"]
