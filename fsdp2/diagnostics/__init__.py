"""Diagnostics: reports, not state: debug logging (``_debug``) and the schedule trace (``_trace``).

The checks between ranks read the runtime's groups: they are the runtime's (``runtime/_checks.py``).
"""
