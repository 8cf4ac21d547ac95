"""The library's version: one place, read by the package, its modules and setup.cfg."""

__version__ = "0.2.0"
