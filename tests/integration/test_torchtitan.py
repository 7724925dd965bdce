"""torchtitan's ``parallelize_llama``, unmodified, on fsdp2 through ``fsdp2.patch_torch()``.

A tiny torchtitan Llama 3 (2 layers, 32 wide, random weights, SDPA attention: FlexAttention
has no CPU backward) is parallelized by torchtitan's own code on 2 gloo ranks: once with
torch's FSDP2 and once inside ``patch_torch()``, where the same code calls fsdp2's
``fully_shard``, builds fsdp2's ``MixedPrecisionPolicy`` and takes its
``isinstance(m, FSDPModule)`` branch (it sets the gradient divide factor to 1 on every group:
torchtitan normalizes the loss itself, so gradients are summed over ranks). Both train 3 AdamW
steps bit for bit alike, and like an unsharded reference whose gradients are summed with
``all_reduce``.

Two things make torchtitan run here, neither touching what is tested: torchtitan imports
``triton`` unconditionally for its expert-parallel kernels (CUDA only, never called by a dense
Llama), so without triton those kernels are loaded against a stand-in that fails if called;
and torchtitan builds its meshes on ``"cuda"`` when no accelerator is found, so its
``device_type`` is set to ``"cpu"``.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp2
from fsdp2.runtime._state import get_state
from tests._dist import run_on_ranks

pytest.importorskip("torchtitan")

STEPS = 3
VOCAB, DIM, SEQ = 64, 32, 8
REF_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


# ---- making torchtitan importable on a CPU-only install ------------------------------------
class _Stand(types.ModuleType):
    """``triton`` / ``triton.language`` for a module that only names them at import."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


class _Placeholder:
    """A triton dtype or annotation (``tl.float32``, ``tl.pointer_type(...)``), never used."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args, **kwargs) -> _Placeholder:
        return self


class _Kernel:
    """A ``@triton.jit`` function: launching it fails loudly."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def _fail(self, *args, **kwargs):
        raise RuntimeError(f"triton is not installed: cannot launch {self.fn.__name__}")

    __call__ = __getitem__ = _fail


def _load_kernels_without_triton() -> None:
    """Load torchtitan's triton kernel module against a stand-in, only where triton is missing.

    Only that file sees the stand-in (it is in ``sys.modules`` just while the file runs, so
    torch's own probes for triton still find none).
    """
    if KERNELS in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    import torchtitan

    triton, language = _Stand("triton"), _Stand("triton.language")
    triton.jit = lambda fn=None, **kwargs: _Kernel(fn) if fn is not None else _Kernel
    triton.language = language
    path = os.path.join(os.path.dirname(torchtitan.__file__), *KERNELS.split(".")[1:]) + ".py"
    spec = importlib.util.spec_from_file_location(KERNELS, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.update({"triton": triton, "triton.language": language})
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]
    sys.modules[KERNELS] = module


# ---- the model and torchtitan's parallelization ----------------------------------------------
def _build(tied: bool):
    """A 2-layer Llama 3 from torchtitan's own config pieces, SDPA attention, same weights on every rank."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    heads = 4
    layers = _build_llama3_layers(n_layers=2, dim=DIM, n_heads=heads, n_kv_heads=2, hidden_dim=64,
                                  rope=ComplexRoPE.Config(dim=DIM // heads, max_seq_len=64, theta=10000.0),
                                  attn_backend="flex")
    for layer in layers:  # torchtitan refuses "sdpa" by name for LMs (it cannot take document masks)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, enable_weight_tying=tied, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM), lm_head=Linear.Config(in_features=DIM, out_features=VOCAB))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = config.build()
        model.init_states()
    return model.train()


def _parallelize(model, precision: str) -> None:
    """torchtitan's parallelize_llama: FSDP over all ranks (the legacy "partial_dtensor" meshes)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    parallel_dims_module.device_type = "cpu"  # torchtitan assumes "cuda" without an accelerator
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    training = TrainingConfig(mixed_precision_param=precision, mixed_precision_reduce="float32")
    parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                      compile_config=CompileConfig(), ac_config=None, dump_folder=os.devnull)


def _step(model, opt, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * step + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    logits = model(tokens[:, :-1])  # (batch, seq, vocab)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def _full(model) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()) for n, p in model.named_parameters()}


def _train(tied: bool, precision: str) -> dict:
    _load_kernels_without_triton()
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    base = _build(tied)
    theirs, ours, ref = copy.deepcopy(base), copy.deepcopy(base), base
    _parallelize(theirs, precision)
    # torchtitan set every module's gradient divide factor to 1 (sum, no division); torch's
    # FSDP2 then reduces with PREMUL_SUM, which gloo lacks. Forcing a plain SUM keeps the same
    # arithmetic (the factor is 1) and lets torch's run on gloo.
    for m in theirs.modules():
        if isinstance(m, TorchFSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    with fsdp2.patch_torch():
        _parallelize(ours, precision)
    groups = [get_state(m).group for m in ours.modules() if get_state(m) is not None]

    models = {"fsdp2": ours, "torch": theirs}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses: dict[str, list[torch.Tensor]] = {"fsdp2": [], "torch": [], "ref": []}
    for step in range(STEPS):
        for k, m in models.items():
            losses[k].append(_step(m, opts[k], step))
            opts[k].step()
            opts[k].zero_grad()
        if precision == "float32":
            losses["ref"].append(_step(ref, ref_opt, step))
            for p in ref.parameters():
                dist.all_reduce(p.grad)  # summed, as torchtitan's divide factor 1 asks
            ref_opt.step()
            ref_opt.zero_grad()
    mine, torchs = _full(ours), _full(theirs)
    out = {
        "fsdp2_modules": sum(isinstance(m, fsdp2.FSDPModule) for m in ours.modules()),
        "torch_modules": sum(isinstance(m, TorchFSDPModule) for m in theirs.modules()),
        "torch_in_ours": any(isinstance(m, TorchFSDPModule) for m in ours.modules()),
        "groups": len({id(get_state(m)) for m in ours.modules() if get_state(m) is not None}),
        "divide_factors": sorted({g.policy.divide_factor for g in groups if g is not None}),
        "param_dtypes": sorted({str(g.params[0].param_dtype) for g in groups if g is not None}),
        "losses": {k: torch.stack(v) for k, v in losses.items() if v},
        "torch_param_diff": max((mine[n] - torchs[n]).abs().max().item() for n in mine),
        "tied": ours.tok_embeddings.weight is ours.lm_head.weight,
    }
    if precision == "float32":
        reference = _full(ref)
        out["ref_param_diff"] = max((mine[n] - reference[n]).abs().max().item() for n in mine)
    return out


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_parallelize_llama_on_fsdp2_matches_torch_and_reference(tied, precision):
    results = run_on_ranks(_train, 2, tied, precision)
    for r in results:
        # torchtitan's calls, all fsdp2's: 2 blocks and the root, plus the embedding and
        # [norm, lm_head] (untied) or one [embedding, norm, lm_head] group (tied).
        assert r["fsdp2_modules"] == r["torch_modules"] == 6, r
        assert r["groups"] == (5 if not tied else 4), r
        assert not r["torch_in_ours"]
        assert r["divide_factors"] == [1.0], "torchtitan's isinstance(m, FSDPModule) branch reached fsdp2's groups"
        assert r["param_dtypes"] == [f"torch.{precision}"], "torchtitan's MixedPrecisionPolicy reached fsdp2"
        assert r["tied"] == tied
        assert torch.equal(r["losses"]["fsdp2"], r["losses"]["torch"]), r["losses"]
        assert r["torch_param_diff"] == 0.0, r["torch_param_diff"]
        if precision == "float32":
            torch.testing.assert_close(r["losses"]["fsdp2"], r["losses"]["ref"], **REF_TOLERANCE)
            assert r["ref_param_diff"] <= REF_TOLERANCE["atol"], r["ref_param_diff"]
    assert not torch.equal(results[0]["losses"]["fsdp2"], results[1]["losses"]["fsdp2"]), "ranks see different data"
