"""Test stub of Transformer Engine (see tests/te_stub/__init__.py). Not the real package."""
__version__ = "2.6.0"  # the gpu extra pins transformer-engine>=2.3
STUB = True

from transformer_engine import common, pytorch  # noqa: E402,F401
