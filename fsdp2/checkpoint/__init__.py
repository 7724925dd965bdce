"""Checkpoint helpers for ``fully_shard``-ed models, thin layers over torch.distributed.checkpoint.

- :func:`save` / :func:`load`: resume training (model, optimizer, extra state)
  from a sharded DCP checkpoint, atomically, on any number of ranks.
- :func:`verify`: what is wrong with a checkpoint directory (missing,
  truncated or overwritten files against the sizes and CRC-32 sums its
  completion marker keeps); :func:`verify_on_ranks` does the same on every
  rank, each reading its share; :func:`load` runs it first and raises
  :class:`CorruptCheckpointError`.
- :func:`export_full`: one safetensors (or ``torch.save``) file of the full
  model for inference tools, gathered one parameter at a time.
- :func:`load_full`: start from full pretrained weights (safetensors, single
  file or Hugging Face shards): each rank memory-maps and reads only its rows.
- :func:`load_hf` / :func:`export_hf`: a Hugging Face Llama folder (``config.json`` and
  safetensors) into fsdp2's Llama, each rank reading its own rows, and back out, streamed
  into shards; :func:`model_args_from_hf` builds the model's shape from ``config.json``.
- :class:`Snapshotter`: in-memory snapshots of each rank's shards in a RAM file system
  (``/dev/shm``), double-buffered and checksummed, copied to a rank of another node;
  they outlive a killed process (not the host) and restore in seconds.
- ``python -m fsdp2.checkpoint export DCP_DIR OUT.safetensors``: consolidate a
  DCP checkpoint offline, without a process group; ``... export-hf CHECKPOINT DIR``: the same
  as a Hugging Face folder; ``... verify DIR``: check a
  checkpoint, or every checkpoint of a run's directory, offline.

See docs/checkpointing.md.
"""

import importlib

__all__ = ["save", "load", "AsyncSaver", "SaveHandle", "ASYNC_MODES", "verify", "verify_on_ranks",
           "CorruptCheckpointError", "export_full", "load_full",
           "model_args_from_hf", "hf_config", "check_hf_weights", "load_hf", "export_hf", "is_hf_folder",
           "Snapshotter", "SnapshotPlan", "SnapshotAreaError", "snapshot_area"]

# Each public name's home, imported on first use (a module ``__getattr__``): only the DCP
# helpers (``save``, ``load``, ``verify``, ``AsyncSaver``, ...) import torch.distributed.checkpoint,
# which costs every process that imports this package a tenth of a second or more; a training
# run without checkpoints, or one that only reads a Hugging Face folder, never needs it.
_HOME = {
    "ASYNC_MODES": "_async", "AsyncSaver": "_async", "SaveHandle": "_async",
    "CorruptCheckpointError": "_dcp", "load": "_dcp", "save": "_dcp", "verify": "_dcp", "verify_on_ranks": "_dcp",
    "export_full": "_full", "load_full": "_full",
    "check_hf_weights": "_hf", "export_hf": "_hf", "hf_config": "_hf", "is_hf_folder": "_hf", "load_hf": "_hf",
    "model_args_from_hf": "_hf",
    "SnapshotAreaError": "_snapshot", "SnapshotPlan": "_snapshot", "Snapshotter": "_snapshot",
    "snapshot_area": "_snapshot",
}


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
