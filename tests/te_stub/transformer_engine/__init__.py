"""Test stub of Transformer Engine (see tests/te_stub/__init__.py). Not the real package."""
__version__ = "2.20.2"  # the version the gpu extra pins (megatron branches on it)
STUB = True

from transformer_engine import common, pytorch  # noqa: E402,F401
