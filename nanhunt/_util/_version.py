"""The package version (its own module: nothing inside the package imports the root)."""

__version__ = "0.1.0"
