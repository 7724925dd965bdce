"""Public policy types: how parameters are cast and where sharded state lives.

Policies are frozen dataclasses checked in ``__post_init__`` so a bad value is
reported where the user wrote it, not deep inside the first forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims", "QuantizedComm",
           "as_comm_policy"]


def _check_float_dtype(field: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"MixedPrecisionPolicy.{field} must be a torch.dtype or None, got {value!r}; "
            f"pass e.g. {field}=torch.bfloat16"
        )
    if not value.is_floating_point:
        raise ValueError(
            f"MixedPrecisionPolicy.{field} must be a floating-point dtype, got {value}; "
            f"use torch.float32, torch.bfloat16 or torch.float16"
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision.

    The sharded parameters always keep their original dtype (the optimizer
    steps on them). Before the all-gather each shard is cast to
    ``param_dtype``, so the collective moves the smaller dtype and forward and
    backward compute in it. Gradients are reduced in ``reduce_dtype`` and then
    stored on the sharded parameter in its original dtype.

    Args:
        param_dtype: dtype of the unsharded parameters and of the all-gather;
            ``None`` keeps the original dtype.
        reduce_dtype: dtype of the gradient reduce-scatter; ``None`` means
            ``param_dtype`` (or the original dtype when that is ``None`` too).
        output_dtype: if set, floating-point forward outputs are cast to it.
        cast_forward_inputs: cast floating-point forward inputs to
            ``param_dtype`` before the module runs.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_float_dtype(field, getattr(self, field))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                "MixedPrecisionPolicy.cast_forward_inputs must be a bool, "
                f"got {self.cast_forward_inputs!r}"
            )


_WEIGHT_FORMATS = ("int8", "int4")
_GRAD_FORMATS = ("int8", "int4")
_GRADIENT_AXES = ("shard", "replicate", "both")


@dataclass(frozen=True)
class QuantizedComm:
    """Communication in fewer bits (``fully_shard(..., comm_policy=QuantizedComm(...))``).

    Only what crosses the wire is quantized: the sharded parameters, their gradients and the
    optimizer state stay in full precision, and so do checkpoints. With ``weights="int8"``
    each rank cuts its shard of every floating-point parameter into blocks of ``block_size``
    elements, sends each block as int8 values with one fp32 scale (symmetric: the block's
    largest magnitude maps to 127), and every rank, its own included, rebuilds the unsharded
    parameters from those bytes in ``MixedPrecisionPolicy.param_dtype``: all ranks compute
    with the same weights, each within half a step (``absmax / 254``) of its block's true
    value. The all-gather moves about a quarter of fp32's bytes (half of bf16's); so does the
    gradients' reduction with ``gradients="int8"``.

    Args:
        weights: ``"int8"`` to all-gather the parameters as int8 with per-block scales;
            ``"int4"``: 4-bit values in [-7, 7] (scale ``absmax / 7``, each off by at most
            ``absmax / 14``), two per byte; ``None`` (the default) gathers them as today, bit
            for bit.
        gradients: ``"int8"`` to reduce the gradients quantized (ZeRO++'s qgZ): each rank
            quantizes each destination rank's chunk of its full gradients per block, one
            all-to-all moves the chunks, and the receiver dequantizes and sums them in fp32
            before the usual division; ``"int4"``: the same with 4-bit values in [-7, 7] (scale
            ``absmax / 7``, each off by at most ``absmax / 14``), two per byte, about half of
            int8's bytes; ``None`` (the default) reduce-scatters them as today.
        block_size: elements per scale; smaller blocks follow the values more closely and
            send more scales (4 bytes per block).
        error_feedback: with quantized gradients, keep what quantizing each parameter's
            gradient lost on this rank and add it to the next one before quantizing (so the
            error does not accumulate over steps). Costs one fp32 tensor of the parameter's
            full (padded, unsharded) size per parameter per rank, kept for the run (not in
            ``state_dict()``: a resumed run starts it at zero; docs/quantized-comm.md).

        gradient_axes: which reductions of the gradients are quantized, on an HSDP mesh
            (replicate x shard): ``"shard"`` (the default) the reduce-scatter along the shard
            axis, ``"replicate"`` the all-reduce across the replicas (usually the one between
            nodes), ``"both"`` both. The quantized all-reduce: each replica quantizes its
            reduced shard in ``R`` chunks, an all-to-all sends chunk ``r`` to replica ``r``,
            which sums in fp32, quantizes the sum and all-gathers it; every replica
            dequantizes the same bytes, so replicas stay equal. ``"replicate"`` and ``"both"``
            need an HSDP mesh; error feedback covers the shard axis' quantization only.

    With quantized gradients on the shard axis the group's reduce-scatter runs as an
    all-to-all (counted under ``count_comm_bytes().reduce_scatter``);
    ``set_custom_reduce_scatter`` is refused on such a group. The quantized all-reduce is
    counted under ``count_comm_bytes().all_reduce``.

    Notes:
        A group keeps its transport: the flat collectives (the path NCCL takes), or on CPU
        the exchange (messages or same-host reads), which moves the same quantized bytes
        point to point with the same result, bit for bit. Parameters
        whose tensor subclass gathers its own data (``fsdp_pre_all_gather``) and an ``int``
        ``reshard_after_forward`` are refused (``ValueError``). At world size 1 nothing is
        sent and nothing is quantized.
    """

    weights: str | None = None
    gradients: str | None = None
    block_size: int = 256
    error_feedback: bool = False
    gradient_axes: str = "shard"

    def __post_init__(self) -> None:
        if self.weights is not None and not isinstance(self.weights, str):
            raise TypeError(f"QuantizedComm.weights must be None or a str, got {self.weights!r}; "
                            "pass weights='int8' or 'int4'")
        if self.weights is not None and self.weights not in _WEIGHT_FORMATS:
            raise ValueError(f"QuantizedComm.weights={self.weights!r} is not supported; use 'int8' or 'int4', "
                             "or None to gather the weights unquantized")
        if self.gradients is not None and not isinstance(self.gradients, str):
            raise TypeError(f"QuantizedComm.gradients must be None or a str, got {self.gradients!r}; "
                            "pass gradients='int8' or 'int4'")
        if self.gradients is not None and self.gradients not in _GRAD_FORMATS:
            raise ValueError(f"QuantizedComm.gradients={self.gradients!r} is not supported; use 'int8' or 'int4', "
                             "or None to reduce the gradients in the reduce dtype")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError(f"QuantizedComm.block_size must be an int, got {self.block_size!r}; "
                            "e.g. block_size=256")
        if self.block_size < 1:
            raise ValueError(f"QuantizedComm.block_size={self.block_size} must be positive; e.g. 256 "
                             "(elements per scale)")
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"QuantizedComm.error_feedback must be a bool, got {self.error_feedback!r}")
        if self.error_feedback and self.gradients is None:
            raise ValueError("QuantizedComm(error_feedback=True) needs quantized gradients to correct; "
                             "leave error_feedback=False")
        if not isinstance(self.gradient_axes, str):
            raise TypeError(f"QuantizedComm.gradient_axes must be a str, got {self.gradient_axes!r}; "
                            "pass 'shard', 'replicate' or 'both'")
        if self.gradient_axes not in _GRADIENT_AXES:
            raise ValueError(f"QuantizedComm.gradient_axes={self.gradient_axes!r} is not supported; use 'shard' "
                             "(the default), 'replicate' or 'both'")
        if self.gradient_axes != "shard" and self.gradients is None:
            raise ValueError(f"QuantizedComm(gradient_axes={self.gradient_axes!r}) needs quantized gradients; "
                             "pass gradients='int8' (or 'int4')")
        if self.gradient_axes == "replicate" and self.error_feedback:
            raise ValueError("QuantizedComm(error_feedback=True) corrects the shard axis' quantization, which "
                             "gradient_axes='replicate' leaves unquantized; use gradient_axes='both' or "
                             "error_feedback=False")

    @property
    def weight_block(self) -> int:
        """Elements per scale of the weights' all-gather; 0 when the weights are not quantized."""
        return self.block_size if self.weights is not None else 0

    @property
    def grad_block(self) -> int:
        """Elements per scale of the gradients' reduce-scatter (the shard axis); 0 when it is not quantized."""
        return self.block_size if self.gradients is not None and self.gradient_axes != "replicate" else 0

    @property
    def replicate_grad_block(self) -> int:
        """Elements per scale of HSDP's all-reduce across the replicas; 0 when it is not quantized."""
        return self.block_size if self.gradients is not None and self.gradient_axes != "shard" else 0

    @property
    def weight_bits(self) -> int:
        """Bits per value of the weights' all-gather (8 or 4); 0 when the weights are not quantized."""
        return {"int8": 8, "int4": 4}[self.weights] if self.weights is not None else 0

    @property
    def grad_bits(self) -> int:
        """Bits per value of the gradients' reduction (8 or 4); 0 when the gradients are not quantized."""
        return {"int8": 8, "int4": 4}[self.gradients] if self.gradients is not None else 0


def as_comm_policy(policy: object) -> QuantizedComm | None:
    """``fully_shard``'s ``comm_policy``: None or a :class:`QuantizedComm`."""
    if policy is None or isinstance(policy, QuantizedComm):
        return policy
    raise TypeError(
        f"fully_shard: comm_policy must be None or an fsdp2.QuantizedComm, got {type(policy).__name__} "
        f"{policy!r}; pass for example comm_policy=fsdp2.QuantizedComm(weights='int8', gradients='int8')"
    )


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters and gradients live on the mesh's device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on the CPU.

    They are copied to the compute device for the all-gather, and reduced
    gradient shards are copied back, so the optimizer steps on the CPU. On a
    CPU mesh this is valid and the transfers are no-ops.

    Args:
        pin_memory: pin the CPU copies so host-device copies can run
            asynchronously (ignored when CUDA is not available).
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffloadPolicy.pin_memory must be a bool, got {self.pin_memory!r}")


_MP_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def as_mixed_precision_policy(policy: object) -> MixedPrecisionPolicy:
    """``policy`` as fsdp2's :class:`MixedPrecisionPolicy`.

    Any object with its four fields (torch's ``MixedPrecisionPolicy`` is one) is converted
    field by field, and checked as if written with fsdp2's class: code written for torch's
    ``fully_shard`` can pass its policies unchanged. fsdp2 cannot import torch's class
    (it would import torch's FSDP), so the match is by fields.
    """
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    if all(hasattr(policy, field) for field in _MP_FIELDS):
        return MixedPrecisionPolicy(**{field: getattr(policy, field) for field in _MP_FIELDS})
    raise TypeError(
        f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {type(policy).__name__} {policy!r}; "
        "pass fsdp2.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...) (or torch's, or any object "
        f"with the fields {', '.join(_MP_FIELDS)})"
    )


def as_offload_policy(policy: object) -> OffloadPolicy:
    """``policy`` as fsdp2's :class:`OffloadPolicy` or :class:`CPUOffloadPolicy`.

    torch's ``OffloadPolicy`` (no offloading) and ``CPUOffloadPolicy(pin_memory=...)`` are
    recognised by class name (a class named ``OffloadPolicy`` among the object's bases) and,
    for CPU offload, the ``pin_memory`` field.
    """
    if isinstance(policy, OffloadPolicy):
        return policy
    bases = {cls.__name__ for cls in type(policy).__mro__}
    if "OffloadPolicy" in bases:
        if hasattr(policy, "pin_memory"):
            return CPUOffloadPolicy(pin_memory=policy.pin_memory)
        if "CPUOffloadPolicy" not in bases:
            return OffloadPolicy()
    raise TypeError(
        f"fully_shard: offload_policy must be an OffloadPolicy, got {type(policy).__name__} {policy!r}; "
        "pass fsdp2.CPUOffloadPolicy(pin_memory=...) to keep shards on the CPU, or fsdp2.OffloadPolicy() "
        "(the default) for none (torch's policies are accepted too)"
    )


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which axes of a full SPMD mesh are data-parallel (``fully_shard(..., dp_mesh_dims=...)``).

    With it, ``fully_shard``'s ``mesh`` is the whole mesh (e.g. ``("dp", "tp")``) and every
    parameter is already a DTensor on it with ``Replicate()`` on the data-parallel axes;
    fsdp2 shards over ``shard`` and replicates over ``replicate`` (HSDP), leaving the other
    axes' placements as they are.

    Args:
        shard: the axis name to shard over (a 1-tuple is accepted).
        replicate: the axis name to replicate over (HSDP), or ``None``.
    """

    shard: Union[str, tuple[str, ...], None] = None
    replicate: Union[str, tuple[str, ...], None] = None

    def __post_init__(self) -> None:
        for field in ("shard", "replicate"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, str) and not (
                    isinstance(value, tuple) and all(isinstance(v, str) for v in value)):
                raise TypeError(f"DataParallelMeshDims.{field} must be a mesh axis name (str) or a tuple of them, "
                                f"got {value!r}")
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims: set at least one of shard and replicate, e.g. "
                             "DataParallelMeshDims(shard='dp')")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: Union[str, tuple[str, ...], None]) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)
