"""The recipe's base: its one error, raised by every file that checks a configuration.

It imports nothing, so every file of the recipe (``config.py`` included) may raise it.
"""

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration file or override that does not fit the config dataclasses."""
