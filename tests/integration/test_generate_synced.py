"""transformers' ``generate()`` recognises an fsdp2 model as FSDP and keeps the ranks in step.

Each rank greedily continues a different prompt; the EOS token is one rank 0's continuation
reaches after a few tokens and rank 1's never does, so rank 0 finishes first. A sharded model
must keep running forward on rank 0 (its all-gathers pair with rank 1's) until rank 1 is
done: transformers does that (``synced_gpus``) for modules carrying torch's
``_is_fsdp_managed_module`` marker, which fsdp2 sets. Without it rank 1 would wait in an
all-gather rank 0 never joins; the sharded model's process group has a short timeout so that
fails in seconds instead of hanging. Each rank's tokens are the unsharded model's, and
torch's ``fully_shard`` gives the same.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fsdp2
from tests._dist import run_on_ranks

pytest.importorskip("transformers")

from tests.integration import _hf  # noqa: E402  (needs transformers)

MAX_NEW = 10
PAD = 0  # the configs' pad_token_id
TIMEOUT_S = 20  # a rank waiting this long in an all-gather fails the test instead of hanging


def _prompt(rank: int, step: int) -> torch.Tensor:
    return _hf.batch(step=step, rank=rank)[:1, :4]  # (1, 4): one prompt per rank


def _greedy(model: torch.nn.Module, prompt: torch.Tensor, eos: int | None) -> torch.Tensor:
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW,
                          do_sample=False, eos_token_id=eos, pad_token_id=PAD)[0, prompt.shape[1]:]


def _pick_prompts_and_eos(ref: torch.nn.Module) -> tuple[int, int]:
    """Prompts (by batch step) and a token rank 0's greedy continuation makes early (not first)
    and rank 1's never makes. Random weights often loop on a few tokens: try a few prompts."""
    for step in range(8):
        runs = [_greedy(ref, _prompt(rank, step), None).tolist() for rank in (0, 1)]
        for i, token in enumerate(runs[0][1:-1], start=1):
            if token != PAD and token not in runs[0][:i] and token not in runs[1]:
                return step, token
    raise AssertionError("no prompts where rank 0 stops early and rank 1 does not; change the model seed")


def _short_timeout_mesh() -> DeviceMesh:
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=TIMEOUT_S))
    # A name of its own: DTensor's caches compare meshes by value, and an equal mesh on this
    # group (destroyed at the end) must never stand in for another test's.
    return DeviceMesh.from_group(group, "cpu", mesh_dim_names=(f"generate_{group.group_name}",))


def _generate_synced() -> dict:
    from transformers.distributed.fsdp import is_fsdp_managed_module

    ref = _hf.build("llama-untied").eval()
    step, eos = _pick_prompts_and_eos(ref)
    prompt = _prompt(dist.get_rank(), step)
    want = _greedy(ref, prompt, eos)

    mesh = _short_timeout_mesh()
    ours = _hf.build("llama-untied").eval()
    for layer in _hf.layers(ours):
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(ours, mesh=mesh)
    recognised = is_fsdp_managed_module(ours)
    got = _greedy(ours, prompt, eos)  # no synced_gpus: transformers must turn it on itself
    dist.barrier(group=mesh.get_group())  # a rank stuck above times out rather than waiting here
    theirs = _greedy(_hf.shard(_hf.build("llama-untied").eval(), "torch"), prompt, eos)
    dist.destroy_process_group(mesh.get_group())
    return {"eos": eos, "want": want, "got": got, "theirs": theirs, "recognised": recognised}


def test_generate_keeps_ranks_in_step_when_one_finishes_first():
    results = run_on_ranks(_generate_synced, 2, timeout=180)
    assert all(r["recognised"] for r in results)
    first, second = (r["want"] for r in results)
    assert len(first) < MAX_NEW and first[-1] == results[0]["eos"], "rank 0 must stop at EOS"
    assert len(second) == MAX_NEW, "rank 1 must run to max_new_tokens"
    for r in results:
        # Synced, a rank that finished keeps running forward (its tokens are dropped) until
        # every rank is done: each returns what the unsharded model says, EOS and all.
        assert torch.equal(r["got"], r["want"]), (r["got"], r["want"])
        assert torch.equal(r["got"], r["theirs"]), (r["got"], r["theirs"])
