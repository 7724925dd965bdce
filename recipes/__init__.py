"""Training recipes built on fsdp2: a Llama-style model, its parallelization, and ``train.py``."""
