"""A group of several modules whose forward runs in part: the chunked-loss pattern.

``fully_shard([final_norm, out])`` shards the final norm and the output head as one group.
The model's forward stops before the head, and the loss is computed a chunk of the sequence
at a time by calling the head on its own, each chunk's loss backward separately, then the
hidden states' gradient goes back through the model. Each chunk's gradient must reach the
head's sharded ``.grad`` by the end of that chunk's backward, casts follow the group's
mixed-precision policy, and the result equals an unsharded reference's and torch's
``fully_shard``'s.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2 import record_schedule
from tests._dist import run_on_ranks
from tests._models import make_batch
from tests._parity import assert_params_match, average_grads, full
from tests._torch import COMPLETES_GROUPS_RUN_IN_PART

VOCAB, DIM, CHUNKS = 64, 32, 4


class ChunkableLM(nn.Module):
    """Embedding, a mixing layer, a final norm, an output head; ``hidden=True`` skips the head."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU())
        self.final_norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.out.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor, *, hidden: bool = False) -> torch.Tensor:
        h = self.final_norm(self.mix(self.tok(tokens)))  # (batch, seq, dim)
        return h if hidden else self.out(h)


def _build(tied: bool) -> ChunkableLM:
    torch.manual_seed(3)
    return ChunkableLM(tied)


def _shard(model: ChunkableLM, shard: Callable[..., Any], tied: bool, head_mp: Any, root_mp: Any,
           reshard_after_forward: bool | int) -> ChunkableLM:
    kwargs = {"reshard_after_forward": reshard_after_forward}
    if not tied:
        shard(model.tok, mp_policy=root_mp, **kwargs)
    shard(model.mix, mp_policy=root_mp, **kwargs)
    # The tied weight lives in the embedding and the head: one group holds both.
    tail = [model.tok, model.final_norm, model.out] if tied else [model.final_norm, model.out]
    shard(tail, mp_policy=head_mp, **kwargs)
    shard(model, mp_policy=root_mp, **kwargs)
    return model


def _chunked_step(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                  seen: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
    """Forward without the head, then the head and its loss one sequence chunk at a time,
    then backward through the rest. ``seen(h, logits)`` after each chunk's backward."""
    h = model(tokens, hidden=True)  # (batch, seq, dim)
    pieces = h.detach().float().chunk(CHUNKS, dim=1)
    piece_grads, total = [], torch.zeros(())
    for piece, target in zip(pieces, targets.chunk(CHUNKS, dim=1)):
        piece = piece.contiguous().requires_grad_()
        logits = model.out(piece)  # (batch, seq / CHUNKS, vocab)
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten()) / CHUNKS
        loss.backward()
        piece_grads.append(piece.grad)
        total += loss.detach()
        seen(h, logits)
    h.backward(torch.cat(piece_grads, dim=1).to(h.dtype))
    return total


def _head_grad(model: nn.Module) -> torch.Tensor:
    grad = model.out.weight.grad
    return torch.zeros(()) if grad is None else full(grad).clone()


def _chunked_training(tied: bool, mp: str, reshard_after_forward: bool | int) -> list[float]:
    """Three steps of the chunked loss: fsdp2 against torch's fully_shard, and (without an
    output dtype) against an unsharded reference, after every chunk and every step."""
    rank = dist.get_rank()
    out_dtype = torch.bfloat16 if mp != "none" else None
    policies = {}
    for name, cls in (("fsdp2", fsdp2.MixedPrecisionPolicy), ("torch", TorchMP)):
        # param_dtype: the other groups cast their inputs back to fp32 (the tied embedding's
        # output is the head group's, in bf16).
        head = cls(param_dtype=torch.float32, output_dtype=out_dtype)
        policies[name] = (head, head if mp == "everywhere" else cls(param_dtype=torch.float32))
    ref = _build(tied)
    models = {
        "fsdp2": _shard(copy.deepcopy(ref), fsdp2.fully_shard, tied, *policies["fsdp2"], reshard_after_forward),
    }
    if COMPLETES_GROUPS_RUN_IN_PART:
        models["torch"] = _shard(copy.deepcopy(ref), torch_fully_shard, tied, *policies["torch"],
                                 reshard_after_forward)
    if out_dtype is None:
        models["ref"] = ref
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-2) for name, m in models.items()}
    losses = []
    for step in range(3):
        tokens, targets = make_batch(rank, step, seq=16, vocab=VOCAB)
        results = {}
        for name, model in models.items():
            snapshots, dtypes = [], []

            def seen(h: torch.Tensor, logits: torch.Tensor, model: nn.Module = model) -> None:
                dtypes.append((h.dtype, logits.dtype))
                snapshots.append(_head_grad(model))

            loss = _chunked_step(model, tokens, targets, seen)
            if name == "ref":
                average_grads(model)
                for snapshot in snapshots:
                    dist.all_reduce(snapshot)
                    snapshot /= dist.get_world_size()
            results[name] = (loss, snapshots, dtypes)
        want_dtype = out_dtype or torch.float32
        loss, snapshots, dtypes = results["fsdp2"]
        assert dtypes == [(want_dtype, want_dtype)] * CHUNKS, dtypes
        for before, after in zip(snapshots, snapshots[1:]):
            assert not torch.equal(before, after), "a chunk's gradient did not reach the head's .grad"
        for other in ("torch", "ref"):
            if other in results:
                torch.testing.assert_close(loss, results[other][0], msg=lambda m: f"{other} loss: {m}")
                for k, (got, want) in enumerate(zip(snapshots, results[other][1])):
                    torch.testing.assert_close(got, want, msg=lambda m: f"{other} head grad after chunk {k}: {m}")
        if "torch" in models:
            for (name, theirs), ours in zip(models["torch"].named_parameters(), models["fsdp2"].parameters()):
                torch.testing.assert_close(ours.grad.to_local(), theirs.grad.to_local(),
                                           msg=lambda m: f"{name}: {m}")
        for opt in opts.values():
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
        losses.append(loss.item())
    if "torch" in models:
        for (name, theirs), ours in zip(models["torch"].named_parameters(), models["fsdp2"].parameters()):
            torch.testing.assert_close(ours.to_local(), theirs.to_local(), msg=lambda m: f"{name}: {m}")
    if "ref" in models:
        assert_params_match(models["ref"], models["fsdp2"])
    return losses


@pytest.mark.parametrize("reshard_after_forward", [True, False, 1])
def test_chunked_head_of_a_group_matches_reference_and_torch(reshard_after_forward):
    losses = run_on_ranks(_chunked_training, 2, False, "none", reshard_after_forward)
    assert losses[0] != losses[1]  # each rank trained on its own data


@pytest.mark.parametrize("tied,mp", [(True, "none"), (False, "head_only"), (False, "everywhere"), (True, "head_only")])
def test_chunked_head_with_tied_weights_or_output_dtype_matches_torch(tied, mp):
    run_on_ranks(_chunked_training, 2, tied, mp, True)


def _chunked_schedule(reshard_after_forward: bool, tied: bool = False) -> list[str]:
    """The events of the second chunked step (the first set the forward order the implicit
    prefetch follows): the forward, each chunk, the final backward."""
    default = fsdp2.MixedPrecisionPolicy()
    model = _shard(_build(tied), fsdp2.fully_shard, tied, default, default, reshard_after_forward)
    tokens, targets = make_batch(dist.get_rank(), 0, seq=16, vocab=VOCAB)
    _chunked_step(model, tokens, targets, lambda h, logits: None)
    model.zero_grad()
    events: list[str] = []
    with record_schedule() as log:
        h = model(tokens, hidden=True)
    events += ["-- forward --", *log]
    for k, (piece, target) in enumerate(zip(h.detach().chunk(CHUNKS, dim=1), targets.chunk(CHUNKS, dim=1))):
        piece = piece.contiguous().requires_grad_()
        with record_schedule() as log:
            F.cross_entropy(model.out(piece).flatten(0, 1), target.flatten()).backward()
        events += [f"-- chunk {k} --", *log]
        waiting = [model.mix[0].weight] if tied else [model.tok.weight, model.mix[0].weight]
        for p in waiting:  # for the final backward
            assert isinstance(p, DTensor) == reshard_after_forward, p
    with record_schedule() as log:
        h.backward(torch.ones_like(h))
    return events + ["-- backward --", *log]


def test_chunked_step_gathers_and_reduces_the_group_once_per_chunk_and_leaves_the_rest():
    # Each chunk's backward ends with the group's reduction; it prefetches nothing and
    # reshards nothing the final backward still needs (mix and tok stay gathered when they
    # do not reshard after forward).
    kept = run_on_ranks(_chunked_schedule, 2, False)[0]
    expecttest.assert_expected_inline("\n".join(kept), """\
-- forward --
unshard tok
unshard mix
unshard final_norm,out
-- chunk 0 --
reshard final_norm,out
reduce_scatter final_norm,out
-- chunk 1 --
unshard final_norm,out
reshard final_norm,out
reduce_scatter final_norm,out
-- chunk 2 --
unshard final_norm,out
reshard final_norm,out
reduce_scatter final_norm,out
-- chunk 3 --
unshard final_norm,out
reshard final_norm,out
reduce_scatter final_norm,out
-- backward --
unshard final_norm,out
reshard final_norm,out
reduce_scatter final_norm,out
reshard mix
reduce_scatter mix
reshard tok
reduce_scatter tok""")
    freed = run_on_ranks(_chunked_schedule, 2, True)[0]
    expecttest.assert_expected_inline("\n".join(freed), """\
-- forward --
unshard tok
unshard mix
reshard tok
unshard final_norm,out
reshard mix
reshard final_norm,out
-- chunk 0 --
unshard final_norm,out
reshard final_norm,out
reduce_scatter final_norm,out
-- chunk 1 --
unshard final_norm,out
reshard final_norm,out
reduce_scatter final_norm,out
-- chunk 2 --
unshard final_norm,out
reshard final_norm,out
reduce_scatter final_norm,out
-- chunk 3 --
unshard final_norm,out
reshard final_norm,out
reduce_scatter final_norm,out
-- backward --
unshard final_norm,out
unshard mix
reshard final_norm,out
reduce_scatter final_norm,out
unshard tok
reshard mix
reduce_scatter mix
reshard tok
reduce_scatter tok""")
    # The tied group runs first and its next group is mix: the forward prefetches mix once
    # (not again at the group's second module), and the calls outside the forward not at all.
    tied = run_on_ranks(_chunked_schedule, 2, True, True)[0]
    expecttest.assert_expected_inline("\n".join(tied), """\
-- forward --
unshard tok,final_norm,out
unshard mix
reshard mix
reshard tok,final_norm,out
-- chunk 0 --
unshard tok,final_norm,out
reshard tok,final_norm,out
reduce_scatter tok,final_norm,out
-- chunk 1 --
unshard tok,final_norm,out
reshard tok,final_norm,out
reduce_scatter tok,final_norm,out
-- chunk 2 --
unshard tok,final_norm,out
reshard tok,final_norm,out
reduce_scatter tok,final_norm,out
-- chunk 3 --
unshard tok,final_norm,out
reshard tok,final_norm,out
reduce_scatter tok,final_norm,out
-- backward --
unshard tok,final_norm,out
unshard mix
reshard mix
reduce_scatter mix
reshard tok,final_norm,out
reduce_scatter tok,final_norm,out""")


def _two_partial_forwards() -> None:
    """Two forwards that skip the head, one backward: the norm's gradient has both, the
    head's none, as in the reference and torch."""
    rank = dist.get_rank()
    ref = _build(False)
    ours, theirs = fsdp2.MixedPrecisionPolicy(), TorchMP()
    models = {"fsdp2": _shard(copy.deepcopy(ref), fsdp2.fully_shard, False, ours, ours, True), "ref": ref}
    if COMPLETES_GROUPS_RUN_IN_PART:
        models["torch"] = _shard(copy.deepcopy(ref), torch_fully_shard, False, theirs, theirs, True)
    first, _ = make_batch(rank, 0, seq=16, vocab=VOCAB)
    second, _ = make_batch(rank, 1, seq=16, vocab=VOCAB)
    for model in models.values():
        (model(first, hidden=True).square().mean() - model(second, hidden=True).mean()).backward()
    average_grads(ref)
    for name, p in models["fsdp2"].named_parameters():
        for other in [k for k in ("torch", "ref") if k in models]:  # the same order on every rank
            want = dict(models[other].named_parameters())[name].grad
            if name == "out.weight":
                assert p.grad is None and want is None, (other, p.grad)
            else:
                torch.testing.assert_close(full(p.grad), full(want), msg=lambda m: f"{other} {name}: {m}")


def test_two_forwards_skipping_part_of_a_group_before_one_backward_match_reference_and_torch():
    run_on_ranks(_two_partial_forwards, 2)
