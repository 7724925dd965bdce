"""A test tensor subclass using FSDP's all-gather extension: int8 rows with one fp32 scale per row.

The logical tensor is ``qdata * scale`` (per row); compute ops see it dequantized (to the
tensor's dtype), in-place ops (the optimizer's) requantize the result. Sharding on dim 0
cuts whole rows, so each shard is itself an ``Int8Rows`` with its rows' scales, and
``fsdp_pre_all_gather`` hands FSDP the compact ``(qdata, scale)`` to gather: a quarter of
the fp32 bytes plus 4 bytes per row. It supports the ops torch's and fsdp2's ``fully_shard``
call on a parameter subclass: ``torch.chunk``, ``new_zeros``, a dim-0 ``narrow``, ``copy_``,
``as_strided`` to fewer rows, ``detach``, ``view``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: ``(qdata, scale)`` with ``x ~= qdata * scale``."""
    x = x.detach().float()
    scale = (x.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


class Int8Rows(torch.Tensor):
    """A 2-D float tensor stored as int8 rows and per-row fp32 scales."""

    pre_calls = 0  # fsdp_pre_all_gather calls in this process (the tests check the hook ran)
    post_calls = 0

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                requires_grad: bool = False) -> Int8Rows:
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype, device=qdata.device,
                                                   requires_grad=requires_grad)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                 requires_grad: bool = False) -> None:
        self.qdata, self.scale = qdata, scale

    @classmethod
    def from_float(cls, x: torch.Tensor, requires_grad: bool = False) -> Int8Rows:
        return cls(*quantize(x), dtype=x.dtype, requires_grad=requires_grad)

    def dequantize(self) -> torch.Tensor:
        return (self.qdata.float() * self.scale).to(self.dtype)

    def __repr__(self) -> str:
        return f"Int8Rows({tuple(self.shape)}, {self.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["qdata", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict, dtype: Any, outer_size: Any, outer_stride: Any) -> Int8Rows:
        return Int8Rows(inner["qdata"], inner["scale"], dtype)

    def _like(self, qdata: torch.Tensor, scale: torch.Tensor) -> Int8Rows:
        return type(self)(qdata, scale, self.dtype)

    # ---- FSDP's all-gather extension ------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        Int8Rows.pre_calls += 1
        rows = math.ceil(outer_size[0] / mesh.size())  # the padded shard (uneven sharding)
        pad = rows - self.qdata.shape[0]
        qdata, scale = self.qdata, self.scale
        if pad:
            qdata = torch.cat([qdata, qdata.new_zeros(pad, qdata.shape[1])])
            scale = torch.cat([scale, scale.new_ones(pad, 1)])
        return (qdata.contiguous(), scale.contiguous()), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        Int8Rows.post_calls += 1
        qdata, scale = outputs
        if out is not None:  # refilled in place: out's inner tensors are these outputs
            assert out.qdata.untyped_storage().data_ptr() == qdata.untyped_storage().data_ptr()
            return None
        return Int8Rows(qdata, scale, param_dtype), (qdata, scale)

    # ---- ops ------------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if func._schema.is_mutable and isinstance(args[0], Int8Rows):  # optimizer updates: requantize
            self = args[0]
            value = self.dequantize()
            func(value, *_plain(args[1:]), **_plain(kwargs))
            _requantize_into(self, value)
            return self
        return func(*_plain(args), **_plain(kwargs))


def _plain(tree: Any) -> Any:
    return tree_map(lambda t: t.dequantize() if isinstance(t, Int8Rows) else t, tree)


def _requantize_into(self: Int8Rows, value: torch.Tensor) -> None:
    qdata, scale = quantize(value)
    self.qdata.copy_(qdata)
    self.scale.copy_(scale)


def _detach(self, *_a, **_k):
    return self._like(self.qdata.detach(), self.scale.detach())


def _split(self, size, dim=0):
    assert dim == 0, "Int8Rows splits rows only"
    return [self._like(q, s) for q, s in zip(self.qdata.split(size), self.scale.split(size))]


def _new_zeros(self, size, **kwargs):
    assert len(size) == 2 and size[1] == self.shape[1], size
    return self._like(self.qdata.new_zeros(size), self.scale.new_ones(size[0], 1))


def _slice(self, dim=0, start=None, end=None, step=1):
    assert dim == 0 and step == 1, "Int8Rows slices rows only"
    return self._like(self.qdata[start:end], self.scale[start:end])


def _copy(self, src, non_blocking=False):
    if isinstance(src, Int8Rows):
        self.qdata.copy_(src.qdata)
        self.scale.copy_(src.scale)
    else:
        _requantize_into(self, src)
    return self


def _as_strided(self, size, stride, storage_offset=0):
    rows = size[0]
    assert storage_offset == 0 and tuple(size[1:]) == tuple(self.shape[1:]), (size, stride)
    return self._like(self.qdata[:rows], self.scale[:rows])


def _view(self, size):
    if tuple(size) in (tuple(self.shape), (-1, self.shape[1])):
        return _detach(self)
    if tuple(size) == (-1,):  # torch's fully_shard keeps a flat view of the shard (unused for extensions)
        return self._like(self.qdata.view(-1), self.scale)
    raise NotImplementedError(f"Int8Rows.view{tuple(size)}")


def _to_copy(self, dtype=None, device=None, **kwargs):
    if dtype is not None and dtype != self.dtype:
        return self.dequantize().to(dtype=dtype, device=device)
    return Int8Rows(self.qdata.to(device=device), self.scale.to(device=device), self.dtype)


def _clone(self, **kwargs):
    return self._like(self.qdata.clone(), self.scale.clone())


def _is_pinned(self, *a):
    return self.qdata.is_pinned()


_HANDLERS = {
    aten.detach.default: _detach,
    aten.alias.default: _detach,
    aten.split.Tensor: _split,
    aten.new_zeros.default: _new_zeros,
    aten.slice.Tensor: _slice,
    aten.copy_.default: _copy,
    aten.as_strided.default: _as_strided,
    aten.view.default: _view,
    aten._to_copy.default: _to_copy,
    aten.clone.default: _clone,
    aten.is_pinned.default: _is_pinned,
}


class Int8RowsV1(Int8Rows):
    """The same with the older one-argument ``fsdp_pre_all_gather(self, mesh)`` (even sharding only)."""

    def fsdp_pre_all_gather(self, mesh):
        Int8Rows.pre_calls += 1
        return (self.qdata.contiguous(), self.scale.contiguous()), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if out is not None:
            return None
        return Int8RowsV1(outputs[0], outputs[1], param_dtype), tuple(outputs)
