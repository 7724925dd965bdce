"""How sharded modules behave under the ways real code calls them.

Repeated calls, several forwards per backward, structured outputs, eval / no-grad /
inference forwards, extra forward methods, recovery after an exception, and activation
checkpointing. Numbers are checked against an unsharded reference trained on the same
data with all-reduce-averaged gradients.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fsdp2 import fully_shard, register_fsdp_forward_method
from tests._dist import run_on_ranks
from tests._models import Block, Transformer, lm_loss, make_batch
from tests._parity import assert_params_match, average_grads, train_parity

VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 16


# ---- helpers (run inside ranks) ---------------------------------------------------------
def _assert_all_sharded(model: nn.Module) -> None:
    """Every parameter registered on every module, root included, is a DTensor shard."""
    unsharded = [f"{mod_name}.{name}" for mod_name, m in model.named_modules()
                 for name, p in m._parameters.items() if p is not None and not isinstance(p, DTensor)]
    assert not unsharded, f"parameters left unsharded: {unsharded}"


def _shard_blocks(model: nn.Module, blocks: list[nn.Module], **kwargs) -> nn.Module:
    for block in blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model)


StepFn = Callable[[nn.Module, int], torch.Tensor]


def _lm_step(rank: int, m: nn.Module, step: int) -> torch.Tensor:
    x, y = make_batch(rank, step)
    loss = lm_loss(m(x), y)
    loss.backward()
    return loss.detach()


def _train_both(ref: nn.Module, model: nn.Module, step_fn: StepFn, steps: int, *,
                skip: frozenset[int] = frozenset()) -> list[float]:
    """Run ``step_fn`` (forward + backward, returns the loss) on both models; AdamW step.

    The reference averages its gradients with all-reduce; steps in ``skip`` are not
    run on the reference (the sharded side is expected to handle them itself).
    """
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        if step in skip:
            continue
        ref_loss = step_fn(ref, step)
        average_grads(ref)
        ref_opt.step()
        ref_opt.zero_grad()
        loss = step_fn(model, step)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {step}: {m}")
        losses.append(loss.item())
    assert_params_match(ref, model)
    return losses


# ---- a block called several times in one forward ----------------------------------------
class SharedBlockModel(nn.Module):
    """Embedding, then ``shared`` / ``other`` / ``shared`` (weight-shared recurrence), then a head."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.tok_emb = nn.Embedding(VOCAB, DIM)
            self.shared = Block(DIM, HEADS)
            self.other = Block(DIM, HEADS)
            self.norm = nn.LayerNorm(DIM)
            self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        x = self.shared(x)
        x = self.other(x)
        x = self.shared(x)
        return self.output(self.norm(x))


def _block_called_twice(reshard_after_forward: bool) -> list[float]:
    def shard(model):
        _shard_blocks(model, [model.shared, model.other], reshard_after_forward=reshard_after_forward)
    losses = train_parity(SharedBlockModel, shard, steps=3)
    return losses


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_block_called_twice_in_one_forward_matches_reference(reshard_after_forward):
    losses = run_on_ranks(_block_called_twice, 2, reshard_after_forward)
    assert losses[0] != losses[1]  # ranks saw different data


# ---- several forwards per backward, several backwards per step --------------------------
def _several_forwards_and_backwards() -> None:
    rank = dist.get_rank()
    ref = Transformer()
    model = copy.deepcopy(ref)
    _shard_blocks(model, list(model.layers))

    def two_forwards_one_backward(m: nn.Module, step: int) -> torch.Tensor:
        (xa, ya), (xb, yb) = make_batch(rank, 2 * step), make_batch(rank, 2 * step + 1)
        loss = lm_loss(m(xa), ya) + lm_loss(m(xb), yb)
        loss.backward()
        return loss.detach()

    _train_both(ref, model, two_forwards_one_backward, steps=2)
    _assert_all_sharded(model)

    def two_backwards_one_step(m: nn.Module, step: int) -> torch.Tensor:
        total = torch.zeros(())
        for micro in range(2):
            x, y = make_batch(rank, 10 + 2 * step + micro)
            loss = lm_loss(m(x), y)
            loss.backward()
            total += loss.detach()
        return total

    _train_both(ref, model, two_backwards_one_step, steps=2)
    _assert_all_sharded(model)


def test_several_forwards_per_backward_and_backwards_per_step_match_reference():
    run_on_ranks(_several_forwards_and_backwards, 2)


# ---- structured outputs from sharded submodules -----------------------------------------
Pair = collections.namedtuple("Pair", ["hidden", "aux"])


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    note: str


class TupleBlock(Block):
    def forward(self, x):
        y = super().forward(x)
        return y, y.detach().sum(), "tag"  # a tensor without grad and a non-tensor alongside


class DictBlock(Block):
    def forward(self, x):
        return {"hidden": super().forward(x), "step": 3}


class NamedTupleBlock(Block):
    def forward(self, x):
        y = super().forward(x)
        return Pair(hidden=y, aux=[y.mean()])


class DataclassBlock(Block):
    def forward(self, x):
        return Output(hidden=super().forward(x), note="ok")


class StructuredModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.tok_emb = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList(
                cls(DIM, HEADS) for cls in (TupleBlock, DictBlock, NamedTupleBlock, DataclassBlock))
            self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok_emb(tokens)
        x, _total, tag = self.layers[0](x)
        assert tag == "tag"
        out = self.layers[1](x)
        assert out["step"] == 3
        pair = self.layers[2](out["hidden"])
        assert isinstance(pair, Pair)
        result = self.layers[3](pair.hidden + pair.aux[0])
        assert isinstance(result, Output) and result.note == "ok"
        return self.output(result.hidden)


def _structured_outputs() -> None:
    # reshard_after_forward=True: backward only works if each block was gathered again
    # by the hook on its (nested) outputs.
    train_parity(StructuredModel, lambda m: _shard_blocks(m, list(m.layers), reshard_after_forward=True))


def test_tuple_dict_namedtuple_dataclass_outputs_get_pre_backward_unshard():
    run_on_ranks(_structured_outputs, 2)


# ---- eval / no_grad / inference_mode forwards -------------------------------------------
def _forwards_without_training() -> None:
    rank = dist.get_rank()
    ref = Transformer()
    model = copy.deepcopy(ref)
    _shard_blocks(model, list(model.layers))
    x, _ = make_batch(rank, 0)
    # inference_mode first: the unsharded buffers are first allocated here and must still
    # be usable by autograd in the training steps that follow.
    for name, context, mode in [
        ("inference_mode", torch.inference_mode, "train"),
        ("no_grad", torch.no_grad, "train"),
        ("eval + no_grad", torch.no_grad, "eval"),
        ("eval", torch.enable_grad, "eval"),
    ]:
        for m in (ref, model):
            m.train(mode == "train")
        with context():
            expected, got = ref(x), model(x)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        try:
            _assert_all_sharded(model)
        except AssertionError as e:
            raise AssertionError(f"after a {name} forward: {e}") from None
    # A backward after the eval forward (with grad) still works: the hook gathers again.
    expected.square().mean().backward()
    got.square().mean().backward()
    average_grads(ref)
    for (pname, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{pname}: {m}")
    _assert_all_sharded(model)
    ref.zero_grad()
    model.zero_grad()
    ref.train()
    model.train()
    _train_both(ref, model, functools.partial(_lm_step, rank), steps=2)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)
    _assert_all_sharded(model)


def test_eval_no_grad_and_inference_forwards_match_and_leave_every_param_sharded():
    run_on_ranks(_forwards_without_training, 2)


# ---- register_fsdp_forward_method --------------------------------------------------------
class Generator(Transformer):
    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Greedy decoding; calls ``self.forward`` directly, bypassing the module's hooks."""
        logits_seen = []
        for _ in range(new_tokens):
            logits = self.forward(tokens)[:, -1]
            logits_seen.append(logits)
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        return tokens, logits_seen


def _generate() -> None:
    rank = dist.get_rank()
    ref = Generator()
    model = copy.deepcopy(ref)
    _shard_blocks(model, list(model.layers))
    register_fsdp_forward_method(model, "generate")
    prompt, _ = make_batch(rank, 0, seq=SEQ - 5)
    expected_tokens, expected_logits = ref.generate(prompt, 5)
    tokens, logits = model.generate(prompt, 5)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
    _assert_all_sharded(model)
    # Training still works afterwards.
    _train_both(ref, model, functools.partial(_lm_step, rank), steps=2)
    _assert_all_sharded(model)


def test_registered_generate_matches_reference_and_reshards():
    run_on_ranks(_generate, 2)


# ---- reset_iter_state after an exception ------------------------------------------------
class InjectedFailure(RuntimeError):
    pass


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise InjectedFailure("injected failure in backward")


class FlakyBlock(Block):
    """A block that fails in forward or in backward on demand (on every rank alike)."""

    fail: str | None = None

    def forward(self, x):
        y = super().forward(x)
        if self.fail == "forward":
            raise InjectedFailure("injected failure in forward")
        if self.fail == "backward":
            y = _RaiseInBackward.apply(y)
        return y


def _build_flaky() -> Transformer:
    model = Transformer()
    flaky = FlakyBlock(DIM, HEADS)
    flaky.load_state_dict(model.layers[1].state_dict())
    model.layers[1] = flaky
    return model


def _recover_after_exception(where: str) -> None:
    rank = dist.get_rank()
    ref = _build_flaky()
    model = copy.deepcopy(ref)
    _shard_blocks(model, list(model.layers))
    # Layer 2's all-gather is in flight when layer 1 raises in forward.
    model.layers[0].set_modules_to_forward_prefetch([model.layers[1], model.layers[2]])
    bad_step = 1
    step = functools.partial(_lm_step, rank)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(4):
        if i == bad_step:
            model.layers[1].fail = where
            with pytest.raises(InjectedFailure, match=f"in {where}"):
                step(model, i)
            model.layers[1].fail = None
            model.reset_iter_state()
            opt.zero_grad()
            _assert_all_sharded(model)
            continue  # the reference simply skips this batch
        ref_loss = step(ref, i)
        average_grads(ref)
        ref_opt.step()
        ref_opt.zero_grad()
        loss = step(model, i)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {i}: {m}")
    assert_params_match(ref, model)
    _assert_all_sharded(model)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_reset_iter_state_after_exception_then_training_matches_reference(where):
    run_on_ranks(_recover_after_exception, 2, where)


# ---- activation checkpointing -----------------------------------------------------------
class CheckpointedBlock(Block):
    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=False)


def _build_checkpointed(variant: str) -> Transformer:
    model = Transformer()
    for i, block in enumerate(model.layers):
        if variant == "checkpoint_in_forward":
            inner = CheckpointedBlock(DIM, HEADS)
            inner.load_state_dict(block.state_dict())
            model.layers[i] = inner
        else:
            model.layers[i] = checkpoint_wrapper(block)
    return model


def _activation_checkpointing(variant: str) -> None:
    def shard(model):
        if variant == "wrapper_around_sharded_block":
            # The recomputation goes through the sharded block's own hooks, inside backward.
            _shard_blocks(model, [layer._checkpoint_wrapped_module for layer in model.layers])
        else:  # torchtitan's order: checkpoint, then shard the wrapper
            _shard_blocks(model, list(model.layers))
    build = functools.partial(_build_checkpointed, variant)
    train_parity(build, shard, steps=2)


@pytest.mark.parametrize("variant", ["checkpoint_in_forward", "sharded_wrapper", "wrapper_around_sharded_block"])
def test_activation_checkpointing_matches_reference(variant):
    run_on_ranks(_activation_checkpointing, 2, variant)


# ---- module conversions between steps ------------------------------------------------------
def _converted_between_steps() -> list[float]:
    """Conversions after steps that gathered every group: ``float()`` turning the root's one bf16
    parameter to fp32 (the root rebuilds its buffers, and every unsharded parameter with them, the
    unconverted ones too: they used to keep viewing the freed buffers, and the next forward failed
    with ``setStorage: ... storage of size 0``), a dtype round trip, and ``float()`` / ``cpu()``
    that change nothing (which used to rebuild the buffers all the same)."""
    rank = dist.get_rank()
    conversions = {1: lambda m: m.float(), 2: lambda m: m.double().float(), 3: lambda m: m.cpu()}

    def step_fn(m: nn.Module, step: int) -> torch.Tensor:
        if step in conversions:
            conversions[step](m)
        return _lm_step(rank, m, step)

    ref = Transformer(vocab=VOCAB, dim=DIM, n_heads=HEADS, seq=SEQ)
    ref.unused = nn.Parameter(torch.ones(DIM, dtype=torch.bfloat16))  # (no gradient: AdamW skips it)
    model = copy.deepcopy(ref)
    return _train_both(ref, _shard_blocks(model, list(model.layers)), step_fn, steps=4)


def test_conversions_that_change_nothing_between_steps_keep_training():
    run_on_ranks(_converted_between_steps, 2)
