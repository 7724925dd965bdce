"""Models fsdp2 ships for its recipe and its memory planner: ``fsdp2.models.llama``."""
