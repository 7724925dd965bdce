"""fsdp2: fully sharded data parallelism on DTensor, a drop-in for ``torch.distributed.fsdp.fully_shard``."""

import importlib
import warnings

with warnings.catch_warnings():
    # When fsdp2 is the first to import torch (python -m fsdp2.plan, ...): torch warns at import
    # that numpy is missing. fsdp2 does not need numpy (torch.distributed.checkpoint does: the
    # `checkpoint` extra brings it), so the warning would only be noise. Scoped to torch's
    # import: the filters are restored right after.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch  # noqa: F401

from ._api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy, QuantizedComm
from ._clip import clip_grad_norm_
from .comm._comm import AllGather, ReduceScatter
from .runtime._fully_shard import fully_shard
from .runtime._module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from .diagnostics._bytes import CommBytes, count_comm_bytes
from .diagnostics._trace import record_schedule
from ._wrap import fully_shard_auto
from .patch import patch_torch

__all__ = [
    "fully_shard",
    "fully_shard_auto",
    "patch_torch",
    "FSDPModule",
    "UnshardHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "QuantizedComm",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "AllGather",
    "ReduceScatter",
    "record_schedule",
    "count_comm_bytes",
    "CommBytes",
    "clip_grad_norm_",
    "MemoryTracker",
    "estimate_memory",
]

__version__ = "0.1.0.dev0"

# Loaded on first use, not by `import fsdp2`: the memory tools (the planner builds models on
# the meta device), the Llama model with its tensor-parallel styles, the checkpoint helpers.
_ON_FIRST_USE = {"MemoryTracker": "memory", "estimate_memory": "plan"}
_SUBPACKAGES = ("memory", "models", "checkpoint", "plan")


def __getattr__(name: str):
    if name in _ON_FIRST_USE or name in _SUBPACKAGES:
        module = importlib.import_module(f".{_ON_FIRST_USE.get(name, name)}", __name__)
        value = module if name in _SUBPACKAGES else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ON_FIRST_USE) | set(_SUBPACKAGES))
