"""Public policy types: how parameters are cast and where sharded state lives.

Policies are frozen dataclasses checked in ``__post_init__`` so a bad value is
reported where the user wrote it, not deep inside the first forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"]


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
