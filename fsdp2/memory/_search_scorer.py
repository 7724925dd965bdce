"""The search's scorer: where the step-time model plugs in (``make_scorer``), and a stand-in until it does.

``make_scorer`` is the one place ``--search`` gets its step-time predictions from: the
step-time model (``fsdp2.memory._steptime``: ``model_costs`` once per model shape,
``predict_step_time`` per layout) where it exists; otherwise ``standin_step_time``, a plain
roofline (compute at peak FLOPS, FSDP's collectives overlapped with it, TP's and the pipeline's
bubble not) that ranks layouts coarsely and is labelled as such in the output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..models.llama import ModelArgs
from ._layout import Layout, ModelBuilder

__all__ = ["make_scorer", "StandinHardware", "StandinStep", "STANDIN_HARDWARE", "standin_step_time"]


@dataclass(frozen=True)
class StandinHardware:
    """A node's figures, with the step-time model's ``Hardware`` field names (bytes/s, FLOP/s, s)."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    devices_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    memory: int


# Vendors' published figures: dense bf16 peak, HBM, NVLink per GPU one way, one 400/200 Gb/s NIC per GPU.
STANDIN_HARDWARE = {
    "h100": StandinHardware("h100", 989e12, 3.35e12, 8, 450e9, 5e-6, 50e9, 10e-6, 80 * 2**30),
    "a100": StandinHardware("a100", 312e12, 2.0e12, 8, 300e9, 5e-6, 25e9, 10e-6, 80 * 2**30),
}


@dataclass(frozen=True)
class StandinStep:
    """A predicted step, with the step-time model's ``StepTime`` field names."""

    seconds: float
    compute: float
    recompute: float
    exposed_comm: float
    bubble: float
    optimizer: float
    tokens_per_s_per_device: float
    mfu: float
    limit: str


def _params(m: ModelArgs) -> tuple[float, float]:
    """(parameters, parameters each token computes with): the embedding's lookup computes nothing."""
    attn = m.dim * (m.dim + 2 * m.kv_heads * (m.dim // m.n_heads)) + m.dim * m.dim
    if m.moe_experts:
        ffn_all = 3 * m.dim * m.expert_hidden * (m.moe_experts + m.moe_shared_experts)
        ffn_active = 3 * m.dim * m.expert_hidden * (m.moe_top_k + m.moe_shared_experts)
    else:
        ffn_all = ffn_active = 3 * m.dim * m.ffn_hidden
    output = m.vocab_size * m.dim
    embed = 0 if m.tie_embeddings else output
    return m.n_layers * (attn + ffn_all) + embed + output, m.n_layers * (attn + ffn_active) + output


def standin_step_time(layout: Layout, model: ModelArgs, hw: StandinHardware) -> StandinStep:
    """A roofline step time for ``layout``: a stand-in for the step-time model, coarse by design."""
    total, active = _params(model)
    dp = layout.dp_replicate * layout.dp_shard
    slice_ = layout.tp * layout.pp  # the devices one data-parallel rank's model is split over
    tokens = layout.batch * layout.grad_accum * layout.seq  # per data-parallel rank per step
    model_flops = (6 * active + 6 * model.n_layers * model.dim * layout.seq) * tokens / slice_
    compute = model_flops / hw.peak_flops
    recompute = compute / 3 if layout.activation_checkpointing else 0.0
    comm = layout.comm_policy
    weight_bytes = 1 if comm and comm.weights else (layout.param_dtype.itemsize if layout.param_dtype else 4)
    grad_bytes = 1 if comm and comm.gradients else 4
    shard, node = layout.dp_shard, hw.devices_per_node
    shard_bw = hw.intra_bandwidth if shard * layout.tp <= node else hw.inter_bandwidth
    frac = (shard - 1) / shard
    gathers = 2 if layout.reshard_after_forward else 1
    fsdp = layout.grad_accum * total / slice_ * (gathers * weight_bytes + grad_bytes) * frac / shard_bw
    replicas = layout.dp_replicate
    fsdp += 2 * total / slice_ / shard * 4 * (replicas - 1) / replicas / hw.inter_bandwidth
    act = layout.batch * layout.seq * model.dim * 2 * model.n_layers / layout.pp
    tp_comm = (4 * (3 if layout.activation_checkpointing else 2) * act * (layout.tp - 1) / layout.tp
               / hw.intra_bandwidth * layout.grad_accum) if layout.tp > 1 else 0.0
    exposed = tp_comm + max(0.0, fsdp - compute - recompute)
    per_rank = layout.pp_stages_per_rank or 1
    bubble = ((compute + recompute) * (layout.pp - 1) / (layout.pp_microbatches * per_rank)) if layout.pp > 1 else 0.0
    optimizer = total / slice_ / shard * 20 / hw.hbm_bandwidth  # fp32 param, grad, 2 states read; 2 written
    seconds = compute + recompute + exposed + bubble + optimizer
    parts = {"compute": compute + recompute, "communication": exposed, "bubble": bubble, "optimizer": optimizer}
    per_device = tokens * dp / layout.world / seconds
    return StandinStep(seconds, compute, recompute, exposed, bubble, optimizer, per_device,
                       6 * active * per_device / hw.peak_flops, max(parts, key=parts.__getitem__))


def _hardware(name: str, presets: dict[str, Any], cls: Callable[..., Any]) -> Any:
    """A preset by name, or a JSON file of the hardware's fields."""
    if name in presets:
        return presets[name]
    path = Path(name)
    try:
        fields = json.loads(path.read_text())
        return cls(**fields)
    except OSError:
        raise ValueError(f"--hardware {name}: neither a preset ({', '.join(sorted(presets))}) nor a readable "
                         "JSON file of the hardware's fields") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"--hardware {name}: not a JSON object of the hardware's fields ({e})") from None


def make_scorer(model: ModelArgs, builder: ModelBuilder, hardware: str) -> tuple[Callable[[Layout], Any], Any, str]:
    """(score, hardware, what scores): ``score(layout)`` predicts a step (``StepTime``-like).

    The step-time model is plugged in here and only here (``fsdp2.memory._steptime``); without
    it, the roofline stand-in.
    """
    try:
        from . import _steptime  # type: ignore[attr-defined]
    except ImportError:
        hw = _hardware(hardware, STANDIN_HARDWARE, StandinHardware)
        return (lambda layout: standin_step_time(layout, model, hw)), hw, \
            f"a roofline stand-in for the step-time model ({hw.name})"
    hw = _hardware(hardware, _steptime.HARDWARE, _steptime.Hardware)

    def score(layout: Layout) -> Any:
        return _steptime.predict_step_time(layout, _steptime.model_costs(layout, builder), hw)

    return score, hw, f"the step-time model ({hw.name})"
