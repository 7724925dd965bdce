"""Work the schedule must not do every step, and the fallbacks that keep it correct.

Without a cast or a device move, a group's shards live packed in the all-gather's
send layout, so issuing an all-gather copies nothing; rebinding a parameter's data
(``torch.utils.swap_tensors``) must still be seen by the next all-gather.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2
from tests._dist import run_on_ranks
from tests._models import MLP


class _RecordCopies(TorchDispatchMode):
    """Records (op, bytes written) of every copy op."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "copy" in name:
            targets = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.copies.append((name, sum(t.numel() * t.element_size() for t in targets)))
        return func(*args, **(kwargs or {}))


def _copies_when_issuing_all_gather(param_dtype: torch.dtype | None) -> list[tuple[str, int]]:
    torch.manual_seed(0)
    model = MLP(16)
    fsdp2.fully_shard(model, mp_policy=fsdp2.MixedPrecisionPolicy(param_dtype=param_dtype))
    with _RecordCopies() as mode:
        handle = model.unshard(async_op=True)
    handle.wait()
    model.reshard()
    return mode.copies


def test_all_gather_input_needs_no_copy_without_a_cast():
    without_cast, with_cast = run_on_ranks(_copies_when_issuing_all_gather, 2, None)[0], \
        run_on_ranks(_copies_when_issuing_all_gather, 2, torch.bfloat16)[0]
    # Only the 16-byte header (iteration, group, phase) is written into the send buffer.
    assert without_cast == [("copy_", 16)]
    assert sum(nbytes for _, nbytes in with_cast) > 16  # the bf16 cast is the copy-in: it still happens


def _rebound_data_is_gathered() -> None:
    torch.manual_seed(0)
    model = MLP(8)
    fsdp2.fully_shard(model)
    weight = model.in_proj.weight
    new_full = torch.arange(weight.numel(), dtype=weight.dtype).view(weight.shape)
    # What load_state_dict / module conversions do under
    # torch.__future__.set_swap_module_params_on_conversion(True): the same Python
    # object afterwards holds other local data.
    replacement = nn.Parameter(distribute_tensor(new_full, weight.device_mesh, weight.placements))
    torch.utils.swap_tensors(weight, replacement)
    model.unshard()
    torch.testing.assert_close(model.in_proj.weight.detach(), new_full, rtol=0, atol=0)
    model.reshard()
    assert isinstance(model.in_proj.weight, torch.distributed.tensor.DTensor)
    torch.testing.assert_close(model.in_proj.weight.full_tensor(), new_full, rtol=0, atol=0)


def test_swapped_parameter_data_is_seen_by_the_next_all_gather():
    run_on_ranks(_rebound_data_is_gathered, 2)


def _optimizer_updates_reach_the_all_gather() -> None:
    torch.manual_seed(0)
    model = MLP(8)
    fsdp2.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    model(torch.ones(2, 8)).sum().backward()
    expected = {n: before[n] - 0.5 * p.grad.full_tensor() for n, p in model.named_parameters()}
    opt.step()
    model.unshard()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], rtol=0, atol=0)
    model.reshard()


def test_optimizer_updates_reach_the_all_gather():
    run_on_ranks(_optimizer_updates_reach_the_all_gather, 2)

