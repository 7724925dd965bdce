"""DCP checkpoints of transformers models move between fsdp2 and torch's ``fully_shard``.

A tiny Llama (tied embeddings) or GPT-2 sharded with one implementation trains two AdamW
steps; ``get_state_dict(model, optim)`` and ``dcp.save`` write it; a model built from other
random weights, sharded with the other implementation and given another learning rate loads
it with ``dcp.load`` (in place, into the shards) and ``set_state_dict`` (which also brings the
optimizer's hyperparameters). The loaded model holds the saved parameters and optimizer
state bit for bit, and both go on training in lockstep: equal losses and parameters, bit
for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_on_ranks

pytest.importorskip("transformers")

from tests.integration import _hf  # noqa: E402  (needs transformers)

STEPS_BEFORE, STEPS_AFTER = 2, 2
# 2 layers of 9 (Llama: q, k, v, o, gate, up, down, 2 norms) or 12 (GPT-2: 6 weights, 6 biases),
# then the embedding(s), the output layer when untied and the final norm.
N_PARAMS = {"llama-tied": 2 * 9 + 2, "gpt2": 2 * 12 + 4}


def _sharded(arch: str, impl: str, seed: int, lr: float):
    model = _hf.shard(_hf.build(arch, seed=seed), impl)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _optim_state(model, opt) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}.{k}": _hf.full(v).clone() for p, s in opt.state.items() for k, v in s.items()}


def _save_then_load(arch: str, src_impl: str, dst_impl: str, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    src, src_opt = _sharded(arch, src_impl, seed=0, lr=1e-2)
    for step in range(STEPS_BEFORE):
        _hf.train_step(src, src_opt, step)
    msd, osd = get_state_dict(src, src_opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    # Other weights and another learning rate: the checkpoint must bring both.
    dst, dst_opt = _sharded(arch, dst_impl, seed=1, lr=1e-3)
    differed_before = _hf.first_difference(_hf.full_params(src), _hf.full_params(dst)) is not None
    msd, osd = get_state_dict(dst, dst_opt)  # initialises AdamW's state so DCP has tensors to load into
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)  # in place, into the DTensor shards
    set_state_dict(dst, dst_opt, model_state_dict=msd, optim_state_dict=osd)
    dist.barrier()

    loaded_params = _hf.first_difference(_hf.full_params(src), _hf.full_params(dst))
    loaded_optim = _hf.first_difference(_optim_state(src, src_opt), _optim_state(dst, dst_opt))
    losses = {"src": [], "dst": []}
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        losses["src"].append(_hf.train_step(src, src_opt, step))
        losses["dst"].append(_hf.train_step(dst, dst_opt, step))
    return {
        "differed_before": differed_before,
        "loaded_params": loaded_params,
        "loaded_optim": loaded_optim,
        "optim_keys": len(_optim_state(dst, dst_opt)),
        "lr": dst_opt.param_groups[0]["lr"],
        "losses": {k: torch.stack(v) for k, v in losses.items()},
        "trained_params": _hf.first_difference(_hf.full_params(src), _hf.full_params(dst)),
        "tied": dst.lm_head.weight is dst.get_input_embeddings().weight,
    }


@pytest.mark.parametrize("src_impl,dst_impl", [("fsdp2", "torch"), ("torch", "fsdp2")],
                         ids=["fsdp2_to_torch", "torch_to_fsdp2"])
@pytest.mark.parametrize("arch", ["llama-tied", "gpt2"])
def test_dcp_checkpoint_resumes_across_implementations(arch, src_impl, dst_impl, tmp_path):
    for r in run_on_ranks(_save_then_load, 2, arch, src_impl, dst_impl, str(tmp_path / "ckpt")):
        assert r["differed_before"], "the loading model starts from other weights"
        assert r["loaded_params"] is None, r["loaded_params"]
        assert r["loaded_optim"] is None, r["loaded_optim"]
        assert r["optim_keys"] == 3 * N_PARAMS[arch]  # AdamW: step, exp_avg, exp_avg_sq
        assert r["lr"] == 1e-2
        assert torch.equal(r["losses"]["src"], r["losses"]["dst"]), r["losses"]
        assert r["trained_params"] is None, r["trained_params"]
        assert r["tied"]
