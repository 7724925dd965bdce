"""A Llama-style decoder (``model.py``) and how to shard it (``parallelize.py``)."""

from .model import ModelArgs, Transformer
from .parallelize import ParallelDims, parallelize

__all__ = ["ModelArgs", "Transformer", "ParallelDims", "parallelize"]
