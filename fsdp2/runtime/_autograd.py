"""The autograd functions a module's hooks put in the graph (``ModuleState``, ``_state.py``).

Identities in forward; their backward tells the module's state where backward has got to:
``InputsGradReady`` when a module's inputs' gradients are computed (a group may reduce
there), ``PreBackward`` when a gradient reaches an output under ``torch.func`` transforms.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ._shapes import StateShape

__all__ = ["InputsGradReady", "Pending", "PreBackward"]


class InputsGradReady(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs once their gradients are computed,
    which is after the module's own backward, at the same point on every rank.

    Groups that reduce unused parameters (``set_reduce_scatter_unused_params``) reduce
    there: waiting for every parameter's gradient would wait until the end of backward
    on a rank that skipped a branch, and the ranks would then issue their reduce-scatters
    in different orders. Groups with frozen parameters reduce no earlier (and once every
    trainable gradient is in): backward may use a frozen weight for its input's gradient
    after the trainable ones have theirs (``ParamGroup.waits_for_inputs``).
    """

    generate_vmap_rule = True  # forward-mode AD and torch.func transforms pass through

    @staticmethod
    def forward(ready: Callable[[Pending], None], token: Pending,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tensors

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.ready, ctx.token = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.ready(ctx.token)  # the group's inputs_grad_ready, hidden from torch.compile
        return (None, None, *grads)

    @staticmethod
    def jvp(ctx: Any, _ready: Any, _token: Any, *tangents: torch.Tensor | None) -> tuple[Any, ...]:
        # The outputs are the inputs themselves, so autograd wants views for their tangents too.
        return tuple(t if t is None else t.view_as(t) for t in tangents)


class PreBackward(torch.autograd.Function):
    """Identity on a forward output whose backward runs the module's pre-backward.

    Used under ``torch.func`` transforms only, where outputs that backward will reach may
    report ``requires_grad=False`` inside the transform, so the usual gradient hook on the
    outputs cannot be registered. Applied to the tangent as well, for a backward through it.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(state: StateShape, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.state = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        ctx.state._pre_backward_hook(grad)
        return None, grad

    @staticmethod
    def jvp(ctx: Any, _state: Any, tangent: torch.Tensor | None) -> torch.Tensor | None:
        return None if tangent is None else PreBackward.apply(ctx.state, tangent)


class Pending:
    """One forward's inputs awaiting their gradients (``ParamGroup.inputs_pending``)."""

    __slots__ = ("__weakref__",)

