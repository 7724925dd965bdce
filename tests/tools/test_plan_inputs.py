"""The memory planner's inputs: ``Layout`` and ``ModelBuilder`` validation, and its one Llama.

In-process, no ranks: bad fields fail when the dataclass is made, with a message naming the
fix; a model built on the meta device is simulated as the same model built plainly (tied
weights included); the planner's default model and tensor-parallel plan are the recipe's
(``fsdp2.models.llama``), not a copy.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from fsdp2 import QuantizedComm
from fsdp2.plan import Layout, ModelBuilder, estimate_memory
from fsdp2.models import llama
from fsdp2.models.llama import LLAMA3, ModelArgs, Transformer

SMALL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32)
BASE = dict(world=8, batch=1, seq=16)


@pytest.mark.parametrize("fields,error,match", [
    (dict(world=6, tp=4), ValueError, r"world \(6\) must be divisible by dp_replicate \(1\) x tp \(4\); .*change "
                                      r"world, dp_replicate or tp"),
    (dict(world=0), ValueError, r"Layout.world must be at least 1, got 0"),
    (dict(batch=2.0), TypeError, r"Layout.batch must be an int, got float 2.0"),
    (dict(seq=True), TypeError, r"Layout.seq must be an int, got bool True"),
    (dict(grad_accum=0), ValueError, r"Layout.grad_accum must be at least 1"),
    (dict(param_dtype="bf16"), TypeError, r"Layout.param_dtype must be a torch.dtype or None, got 'bf16'; "
                                          r"e.g. torch.bfloat16"),
    (dict(reduce_dtype=torch.int32), ValueError, r"Layout.reduce_dtype must be a floating-point dtype"),
    (dict(reshard_after_forward=None), TypeError, r"Layout.reshard_after_forward must be True, False or an int"),
    (dict(reshard_after_forward=3), ValueError, r"reshard_after_forward=3 must divide dp_shard \(8\).*one of "
                                                r"\[1, 2, 4, 8\] or a bool"),
    (dict(reshard_after_forward=0), ValueError, r"reshard_after_forward=0 must divide dp_shard"),
    (dict(reshard_after_forward=2, tp=2), ValueError, r"reshard_after_forward=2 \(an int\) is not supported with "
                                                      r"tp > 1: use True or False"),
    (dict(reshard_after_forward=2, comm_policy=QuantizedComm(weights="int8")), ValueError,
     r"not supported with comm_policy with quantized weights"),
    (dict(cpu_reads=1), TypeError, r"Layout.cpu_reads must be True or False, got 1"),
    (dict(optimizer="lion"), ValueError, r"optimizer must be one of \['adam', 'adamw', 'sgd', 'sgd_momentum'\]"),
    (dict(backend="mpi"), ValueError, r"backend must be 'nccl' or 'gloo', got 'mpi'"),
])
def test_layout_refuses_bad_fields_naming_the_fix(fields, error, match):
    with pytest.raises(error, match=match):
        Layout(**{**BASE, **fields})


def test_layout_int_reshard_is_normalized_as_fully_shard_resolves_it():
    # 1 rank keeps everything (False); the whole shard axis is True; between, the int stays.
    assert Layout(**BASE, reshard_after_forward=1).reshard_after_forward is False
    assert Layout(**BASE, reshard_after_forward=8).reshard_after_forward is True
    assert Layout(**BASE, reshard_after_forward=4).reshard_after_forward == 4
    assert Layout(**BASE, reshard_after_forward=2, comm_policy=QuantizedComm(gradients="int8")).reshard_after_forward \
        == 2  # quantized gradients alone: fully_shard runs it
    # With dp_replicate 2, the shard axis is 4 (and 4 is True).
    assert Layout(**BASE, dp_replicate=2, reshard_after_forward=4).reshard_after_forward is True


def test_layout_is_keyword_only_frozen_and_checked_again_on_replace():
    layout = Layout(world=16, batch=2, seq=128, dp_replicate=2, tp=4)
    assert layout.dp_shard == 2
    with pytest.raises(TypeError):
        Layout(16, 2, 128)  # keyword-only: the fields are too alike to pass by position
    with pytest.raises(AttributeError):
        layout.tp = 8  # frozen: change it with dataclasses.replace
    with pytest.raises(ValueError, match=r"world \(16\) must be divisible by dp_replicate \(2\) x tp \(3\)"):
        replace(layout, tp=3)


def test_model_builder_refuses_bad_fields():
    with torch.device("meta"):
        model = Transformer(SMALL)
    with pytest.raises(TypeError, match=r"must be a function that makes it \(its class, or lambda: Model\(args\)\), "
                                        r"got a Transformer instance"):
        ModelBuilder(build=model)
    with pytest.raises(TypeError, match=r"got a Transformer instance"):
        estimate_memory(Layout(**BASE), model)  # estimate_memory wraps a bare model the same way
    with pytest.raises(TypeError, match=r"must be a function that makes it"):
        ModelBuilder(build="llama3_8b")
    with pytest.raises(ValueError, match=r"ModelBuilder.num_blocks must be at least 1, got 0"):
        ModelBuilder(build=lambda: Transformer(SMALL), num_blocks=0)
    with pytest.raises(TypeError, match=r"ModelBuilder.tp_plan must be a function \(model, tp_mesh\) or None"):
        ModelBuilder(build=lambda: Transformer(SMALL), tp_plan="megatron")
    with pytest.raises(TypeError, match=r"ModelBuilder.loss_fn must be a function, got None"):
        ModelBuilder(build=lambda: Transformer(SMALL), loss_fn=None)


def test_estimate_memory_refuses_bad_arguments():
    with pytest.raises(TypeError, match=r"layout must be a fsdp2.plan.Layout, got dict; e.g. Layout\(world=8"):
        estimate_memory(dict(BASE), ModelBuilder.llama(SMALL))
    with pytest.raises(ValueError, match=r"estimate_memory.gpu_memory must be at least 1, got -1"):
        estimate_memory(Layout(**BASE), ModelBuilder.llama(SMALL), gpu_memory=-1)
    with pytest.raises(TypeError, match=r"ModelBuilder.build\(\) must return an nn.Module, got str"):
        estimate_memory(Layout(**BASE), lambda: "a model")


def test_a_model_made_before_the_call_is_refused_and_left_as_it_was():
    with torch.device("meta"):
        made = Transformer(SMALL)
    with pytest.raises(TypeError, match=r"returned a model made before the call .* make a new one inside the function"):
        estimate_memory(Layout(**BASE), lambda: made)
    assert all(p.is_meta for p in made.parameters())


@pytest.mark.parametrize("tie", [False, True])
def test_a_model_built_on_the_meta_device_is_simulated_as_built_plainly(tie):
    args = replace(SMALL, tie_embeddings=tie)

    def on_meta() -> nn.Module:
        with torch.device("meta"):
            return Transformer(args)

    layout = Layout(world=4, batch=2, seq=16, backend="gloo")
    plain = estimate_memory(layout, ModelBuilder(build=lambda: Transformer(args)))
    meta = estimate_memory(layout, ModelBuilder(build=on_meta))
    assert meta == plain
    untied = estimate_memory(layout, ModelBuilder(build=lambda: Transformer(replace(SMALL, tie_embeddings=False))))
    # A tied output shares the embedding's weight: one parameter fewer to shard (the meta path keeps the tie).
    assert (plain.peak_by_category["sharded_params"] < untied.peak_by_category["sharded_params"]) == tie


def test_llama_builder_builds_two_blocks_of_meta_published_shapes():
    # Meta's Llama 3 SwiGLU widths, from ffn_dim_multiplier and multiple_of.
    assert {name: args.ffn_hidden for name, args in LLAMA3.items()} == {
        "llama3_8b": 14336, "llama3_70b": 28672, "llama3_405b": 53248}
    builder = ModelBuilder.llama("llama3_70b")
    assert builder.num_blocks == 80 and builder.tp_plan is None  # the Llama's own plan, chosen for its type
    with torch.device("meta"):
        model = builder.build()
    assert isinstance(model, Transformer) and len(model.layers) == 2 and model.args.dim == 8192
    assert LLAMA3["llama3_70b"].n_layers == 80  # the shared config is not changed
    with pytest.raises(ValueError, match=r"unknown Llama config 'llama3_7b'; choose one of \['llama3_405b', "):
        ModelBuilder.llama("llama3_7b")


def test_default_model_is_the_recipes_llama_3_8b():
    layout = Layout(world=8, batch=1, seq=32)
    default = estimate_memory(layout)
    assert default == estimate_memory(layout, ModelBuilder.llama("llama3_8b"))
    assert "32 blocks" in default.layout


def test_the_recipe_trains_the_planners_model_and_plan():
    """One model and one tensor-parallel plan: the recipe imports the package's, it has no copy."""
    from recipes.llama import model as recipe_model
    from recipes.llama.parallelize import check_tp, tp_plan  # (recipes.llama.parallelize is also a function)

    for name in ("ModelArgs", "Transformer", "Block", "Attention", "FeedForward", "precompute_rope", "apply_rope"):
        assert getattr(recipe_model, name) is getattr(llama, name), name
    assert tp_plan is llama.tp_plan and check_tp is llama.check_tp
    # The planner's default plan, with tp > 1, is that one (its note says so).
    est = estimate_memory(Layout(world=4, tp=2, batch=1, seq=16), ModelBuilder.llama(SMALL))
    assert est.notes == ["tensor parallelism simulated with the recipe Llama plan"]
