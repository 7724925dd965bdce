"""The CPU transport: exchanges by point-to-point messages or same-host reads.

Self-contained: it knows nothing of the runtime. Used only for CPU groups (gloo);
off where it cannot run.
"""
