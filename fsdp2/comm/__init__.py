"""The transport: how a group's all-gather and reduce-scatter move bytes.

The flat collectives (``all_gather_into_tensor`` / ``reduce_scatter_tensor``, the path
NCCL takes), custom comms and CUDA streams live here; the CPU exchange is the
subpackage ``cpu``, which GPU users never reach. No public names here: import them
from ``fsdp2``.
"""
