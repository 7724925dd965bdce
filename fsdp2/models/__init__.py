"""Models fsdp2 ships for its recipe and its memory planner: ``fsdp2.models.llama``, and its Hugging Face
``config.json`` reader (``fsdp2.models.hf_config``)."""
