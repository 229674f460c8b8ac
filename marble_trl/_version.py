"""The package version (pyproject.toml's `version` is the same string)."""

__version__ = "0.1.0.dev0"
