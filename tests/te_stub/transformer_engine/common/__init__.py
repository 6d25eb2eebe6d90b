from transformer_engine.common import recipe  # noqa: F401
