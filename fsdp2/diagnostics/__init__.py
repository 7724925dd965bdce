"""Diagnostics: checks that the ranks agree, debug logging, the schedule trace."""
