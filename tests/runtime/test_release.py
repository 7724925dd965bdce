"""What a group that holds other groups (the root) gives back before the end of backward
(``EarlyRelease``).

By default, as torch's FSDP2, the root keeps its parameters unsharded from forward to the end
of backward (what user code sees then: test_root_weights.py), and backward reduces each of its
gradients once it is final (the output head's, when backward reaches the blocks) instead of
at the end. With ``set_early_release(True)`` it also frees its parameters a part at a time:
after forward the parts nothing in backward will read (an embedding table: its backward needs
the indices only), in backward the parts whose gradients are final and whose storage no saved
tensor holds. Each test trains fsdp2 against an unsharded reference (``train_parity``) on both
CPU transports, and the cases where freeing would be wrong (weights that forward saved for
backward in every way it can, forwards re-run in backward by activation checkpointing, a
module whose gradient arrives twice) must keep or regather the parameters: reading a freed one
fails (or crashes) the backward.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from tests._dist import environ, run_on_ranks
from tests._models import Block, Transformer, lm_loss, make_batch
from tests._parity import train_parity

TRANSPORTS = ("flat", "read")  # (the small test models' groups would take the flat path under "auto")
DIM, VOCAB = 32, 64


def _shard_blocks_then_root(model: nn.Module, early: bool = False) -> nn.Module:
    for block in model.layers:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    model.set_early_release(early)
    return model


def _shard_early(model: nn.Module) -> nn.Module:
    return _shard_blocks_then_root(model, early=True)


def _released(module: nn.Module) -> bool:
    """Whether ``module``'s weight is back to its shard (its unsharded storage freed)."""
    return isinstance(module.weight, DTensor)


def _transformer_parity_and_releases(transport: str, early: bool) -> list[tuple[bool, ...]]:
    seen: list[tuple[bool, ...]] = []

    def shard(model: Transformer) -> None:
        _shard_blocks_then_root(model, early)
        model.register_forward_hook(  # after the root's own post-forward hook
            lambda m, _args, _out: seen.append(("forward", _released(m.tok_emb), _released(m.pos_emb),
                                                _released(m.norm), _released(m.output))))
        model.layers[0].register_full_backward_pre_hook(  # backward has passed every later block
            lambda m, _grad: seen.append(("backward", _released(model.tok_emb), _released(model.output),
                                          _released(model.norm))))

    with environ(CPU_COLLECTIVES_ENV, transport):
        train_parity(Transformer, shard, steps=4, check_every_step=True)
    return seen


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.slow
def test_root_kept_whole_by_default(transport: str) -> None:
    seen = run_on_ranks(_transformer_parity_and_releases, 2, transport, False)[0]
    assert seen == [("forward", False, False, False, False), ("backward", False, False, False)] * 4


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.slow
def test_root_parts_freed_early_with_parity(transport: str) -> None:
    seen = run_on_ranks(_transformer_parity_and_releases, 2, transport, True)[0]
    forwards = [s[1:] for s in seen if s[0] == "forward"]
    backwards = [s[1:] for s in seen if s[0] == "backward"]
    # Embeddings freed after every forward (their backward reads no weight); norm and head kept.
    assert forwards == [(True, True, False, False)] * 4
    # From the second backward on, the head and final norm are freed once the blocks' backward
    # starts (the first backward finds out whether a gradient can arrive twice).
    assert backwards == [(True, False, False)] + [(True, True, True)] * 3


def _reduce_scatters_per_step(early: bool) -> list[int]:
    model = _shard_blocks_then_root(Transformer(), early)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counts = []
    for step in range(3):
        inputs, targets = make_batch(dist.get_rank(), step)
        with fsdp2.record_schedule() as events:
            lm_loss(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad()
        counts.append(sum(e == "reduce_scatter root" for e in events))
    return counts


def test_root_reduces_final_gradients_early() -> None:
    # By default one reduce-scatter of the root's gradients per step, at the end of backward
    # (as torch's FSDP2). With early release, from the second step on, the head's and norm's
    # when backward reaches the last block, the embeddings' at the end.
    assert run_on_ranks(_reduce_scatters_per_step, 2, False) == [[1, 1, 1]] * 2
    assert run_on_ranks(_reduce_scatters_per_step, 2, True) == [[1, 2, 2]] * 2


class _CtxLinear(torch.autograd.Function):
    """A linear layer that keeps its weight as a Python attribute of ``ctx``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight
        ctx.save_for_backward(x)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (x,) = ctx.saved_tensors
        return grad @ ctx.weight, (grad.flatten(0, -2).t() @ x.flatten(0, -2))


class _Scale(nn.Module):
    """``x * weight``: autograd saves the parameter itself."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(DIM) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _OnCtx(nn.Module):
    """A linear layer whose autograd function keeps the parameter as a Python attribute of ``ctx``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CtxLinear.apply(x, self.weight)


class _Detached(nn.Module):
    """A gate computed from the parameter's ``detach()`` alias (no gradient for it): autograd saves
    a view of that alias, which shares the parameter's storage but not the parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x @ self.weight.detach().t())


class _Holders(nn.Module):
    """Root-owned modules whose weights backward reads, one way each (each module's parameters
    are a segment of their own), and an embedding, which backward does not read."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM, 4) for _ in range(2))
        self.scale = _Scale()
        self.proj = nn.Linear(DIM, DIM, bias=False)  # saves weight.t(), a view of the parameter
        self.on_ctx = _OnCtx()
        self.detached = _Detached()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.detached(self.on_ctx(self.proj(self.scale(x)))))


def _holders(transport: str) -> list[str]:
    kept: list[str] = []
    names = ("emb", "scale", "proj", "on_ctx", "detached", "head")

    def shard(model: _Holders) -> None:
        _shard_early(model)
        model.register_forward_hook(
            lambda m, _a, _o: kept.__setitem__(slice(None), [n for n in names if not _released(getattr(m, n))]))

    with environ(CPU_COLLECTIVES_ENV, transport):
        train_parity(_Holders, shard, steps=3, check_every_step=True)
    return kept


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_weights_backward_reads_are_kept(transport: str) -> None:
    assert run_on_ranks(_holders, 2, transport)[0] == ["scale", "proj", "on_ctx", "detached", "head"]


class _Checkpointed(Transformer):
    """The head (a root-owned module) under activation checkpointing: forward saves nothing of
    it, and backward re-runs it."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        return checkpoint(lambda h: self.output(self.norm(h)), x, use_reentrant=self.reentrant)


def _checkpointed(transport: str, reentrant: bool) -> list[bool]:
    released: list[bool] = []

    def shard(model: _Checkpointed) -> None:
        _shard_early(model)
        model.register_forward_hook(lambda m, _a, _o: released.append(_released(m.output)))

    with environ(CPU_COLLECTIVES_ENV, transport):
        train_parity(lambda: _Checkpointed(reentrant), shard, steps=3, check_every_step=True)
    return released


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.slow
def test_checkpointed_root_module_is_gathered_again(transport: str, reentrant: bool) -> None:
    # Freed after forward (nothing saved), gathered again when backward re-runs it.
    assert run_on_ranks(_checkpointed, 2, transport, reentrant)[0] == [True] * 3


class _SharedTwice(nn.Module):
    """A root-owned module run twice, each under reentrant checkpointing, with sharded blocks
    between: its gradient is accumulated once per re-run, so it is final only at the end.
    ``twice=False`` runs it once (a gradient final once accumulated)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.shared = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(Block(DIM, 4) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.twice = True

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        x = checkpoint(self.shared, x, use_reentrant=True)
        x = self.layers[0](x)
        if self.twice:
            x = checkpoint(self.shared, x, use_reentrant=True)
        x = self.layers[1](x)
        return self.head(x)


def _shared_twice(transport: str, early: bool) -> None:
    with environ(CPU_COLLECTIVES_ENV, transport):
        train_parity(_SharedTwice, _shard_early if early else _shard_blocks_then_root, steps=3,
                     check_every_step=True)


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.slow
def test_gradient_arriving_twice_disables_early_release(transport: str, early: bool) -> None:
    run_on_ranks(_shared_twice, 2, transport, early)


def _train_against_reference(transport: str, early: bool, steps: int, run: Callable[[nn.Module, int, list], None],
                             build: Callable[[], nn.Module] = Transformer) -> None:
    """``steps`` steps of a sharded ``build()`` and its unsharded reference, each step's forwards
    and backwards by ``run(model, step, batches)`` (two batches per step); equal parameters after
    every step."""
    torch.manual_seed(0)
    ref = build()
    with environ(CPU_COLLECTIVES_ENV, transport):  # read when each group is built
        model = _shard_blocks_then_root(build(), early)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    rank = dist.get_rank()
    for step in range(steps):
        batches = [make_batch(rank, 2 * step), make_batch(rank, 2 * step + 1)]
        for m, opt in zip((ref, model), opts):
            run(m, step, batches)
            if m is ref:
                for p in ref.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
            opt.step()
            opt.zero_grad()
        for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
            torch.testing.assert_close(p.full_tensor(), p_ref.detach(), msg=lambda m: f"{step} {name}: {m}")


def _second_gradient_after_early_reduction(transport: str, early: bool) -> list[int]:
    """The shared module runs once per forward in the first two steps (its gradient is reduced
    early in the second), then twice: its second gradient arrives after the first was reduced.
    The root's reduce-scatters per step."""
    counts = []

    def run(m: nn.Module, step: int, batches: list) -> None:
        m.twice = step >= 2
        (a, ta), _ = batches
        with fsdp2.record_schedule() as events:
            lm_loss(m(a), ta).backward()
        if isinstance(m, fsdp2.FSDPModule):
            counts.append(sum(e == "reduce_scatter root" for e in events))

    _train_against_reference(transport, early, 4, run, _SharedTwice)
    return counts


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_second_gradient_after_early_reduction_is_reduced_at_the_end(transport: str) -> None:
    # Step 1 reduces the head's gradient early, the rest at the end. Step 2 reduces the head's,
    # then the shared module's first gradient early, and its second with the embeddings' at
    # the end. From then on, all at the end.
    assert run_on_ranks(_second_gradient_after_early_reduction, 2, transport, True)[0] == [1, 2, 3, 1]


def _retain_graph_and_two_forwards(transport: str, early: bool) -> None:
    """Backward twice through one graph; two forwards summed into one backward."""
    def run(m: nn.Module, step: int, batches: list) -> None:
        (a, ta), (b, tb) = batches
        if step == 1:  # twice through the same graph
            loss = lm_loss(m(a), ta)
            loss.backward(retain_graph=True)
            loss.backward()
        else:  # two forwards, then one backward
            (lm_loss(m(a), ta) + lm_loss(m(b), tb)).backward()

    _train_against_reference(transport, early, 3, run)


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.slow
def test_retain_graph_and_two_forwards(transport: str, early: bool) -> None:
    run_on_ranks(_retain_graph_and_two_forwards, 2, transport, early)


def _two_forwards_per_step(transport: str, early: bool) -> list[dict[str, int]]:
    """Two forwards summed into one loss every step: the root's all-gathers and releases in
    each step's forwards, trained against the unsharded reference."""
    counts = []

    def run(m: nn.Module, _step: int, batches: list) -> None:
        (a, ta), (b, tb) = batches
        with fsdp2.record_schedule() as events:
            loss = lm_loss(m(a), ta) + lm_loss(m(b), tb)
        if isinstance(m, fsdp2.FSDPModule):
            counts.append({e: events.count(f"{e} root") for e in ("unshard", "release")})
        loss.backward()

    _train_against_reference(transport, early, 3, run)
    return counts


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_forwards_per_step_gather_the_root_once(transport: str) -> None:
    # By default the root keeps its parameters from forward to backward: one gather per step.
    once = {"unshard": 1, "release": 0}
    assert run_on_ranks(_two_forwards_per_step, 2, transport, False)[0] == [once] * 3


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_forwards_per_step_gather_the_root_once_from_the_second_step(transport: str) -> None:
    # With early release, the first step finds the embeddings its first forward freed still
    # freed at the second forward, and gathers the root again; from then on forwards free
    # nothing and the root is gathered once per step, as torch's FSDP2 does.
    once = {"unshard": 1, "release": 0}
    assert run_on_ranks(_two_forwards_per_step, 2, transport, True)[0] == [{"unshard": 2, "release": 1}, once, once]


def _early_release_after_the_buffer_exists() -> str:
    model = _shard_blocks_then_root(Transformer())
    model.set_early_release(False)  # (turning it off is always allowed)
    lm_loss(model(make_batch(dist.get_rank(), 0)[0]), make_batch(dist.get_rank(), 0)[1]).backward()
    model.set_early_release(False)
    with pytest.raises(RuntimeError, match=r"call it before the module's first forward"):
        model.set_early_release(True)
    with pytest.raises(TypeError, match="enabled"):
        model.set_early_release(1)
    return "refused"


def test_early_release_is_set_before_the_first_forward() -> None:
    assert run_on_ranks(_early_release_after_the_buffer_exists, 2) == ["refused"] * 2
