"""What the installed torch's own FSDP2 has, for the tests that compare fsdp2 with it.

fsdp2 supports torch 2.11 to 2.14 (pyproject.toml) and offers torch 2.13's FSDP2 surface on
each of them. torch's older releases lack some of it, so a test comparing with torch's
``fully_shard`` compares where torch has the feature and checks fsdp2 against the unsharded
reference alone where it does not; fsdp2's own behaviour is checked on every version.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed.fsdp as torch_fsdp

TORCH_VERSION: tuple[int, int] = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

# torch 2.13 added these to its FSDP2 (2.11 has none of them; 2.12 is not in CI).
HAS_DATA_PARALLEL_MESH_DIMS = hasattr(torch_fsdp, "DataParallelMeshDims")
HAS_REDUCE_SCATTER_UNUSED_PARAMS = hasattr(torch_fsdp.FSDPModule, "set_reduce_scatter_unused_params")
# torch 2.11's FSDP2 fails under torch.func.jvp ("Cannot access storage of TensorWrapper" in its
# all-gather's buffer allocation); 2.13 runs it.
FSDP2_RUNS_UNDER_JVP = TORCH_VERSION >= (2, 13)
# torch 2.11 fails inside fully_shard with an AttributeError when shard_placement_fn returns a
# placement other than Shard; 2.13 raises a ValueError naming the problem.
CHECKS_SHARD_PLACEMENT_TYPE = TORCH_VERSION >= (2, 13)
# torch 2.13 completes a group of several modules whose forward ran some of them (a chunked loss
# runs the head of fully_shard([norm, head]) on its own); 2.11 leaves the group half-way.
COMPLETES_GROUPS_RUN_IN_PART = hasattr(
    importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_state").FSDPState,
    "_force_complete_incomplete_states")
# torch 2.13 refuses, at the first forward, a parameter that separate fully_shard calls sharded
# twice (tied weights in two groups); 2.11 trains the two copies apart, silently.
REFUSES_PARAMS_IN_TWO_GROUPS = hasattr(
    importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_state").FSDPState,
    "_validate_no_duplicate_params")
