"""The package version, one place (the wheel's metadata reads it too)."""

__version__ = "0.1.0"
