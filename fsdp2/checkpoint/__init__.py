"""Checkpoint helpers for ``fully_shard``-ed models, thin layers over torch.distributed.checkpoint.

- :func:`save` / :func:`load`: resume training (model, optimizer, extra state)
  from a sharded DCP checkpoint, atomically, on any number of ranks.
- :func:`verify`: what is wrong with a checkpoint directory (missing or
  truncated files against the list its completion marker keeps), without
  reading the data; :func:`load` runs it first and raises
  :class:`CorruptCheckpointError`.
- :func:`export_full`: one safetensors (or ``torch.save``) file of the full
  model for inference tools, gathered one parameter at a time.
- :func:`load_full`: start from full pretrained weights (safetensors, single
  file or Hugging Face shards): each rank memory-maps and reads only its rows.
- ``python -m fsdp2.checkpoint export DCP_DIR OUT.safetensors``: consolidate a
  DCP checkpoint offline, without a process group.

See docs/checkpointing.md.
"""

from ._dcp import CorruptCheckpointError, load, save, verify
from ._full import export_full, load_full

__all__ = ["save", "load", "verify", "CorruptCheckpointError", "export_full", "load_full"]
