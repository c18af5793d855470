"""The package version (pyproject.toml says the same; the CLI and the API read it here)."""

__version__ = "0.1.0"
