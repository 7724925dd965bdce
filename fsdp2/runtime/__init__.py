"""The runtime: what ``fully_shard`` builds and the hooks that drive it.

Module state and hooks (``_state``), the per-call parameter groups and their state
machine (``_group``), sharded parameters (``_param``), the reduce queue, state-dict
hooks. It asks the transport (``fsdp2.comm``) to move bytes and never asks which one
it has. No public names here: import them from ``fsdp2``.
"""
