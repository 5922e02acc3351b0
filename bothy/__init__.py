"""Bothy: an agent harness you can leave on a client's machine and walk away from."""

__all__ = ["__version__"]

__version__ = "0.1.0"
