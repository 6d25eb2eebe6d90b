"""Test and demo fixtures: tiny HF checkpoints and tokenizers built locally (no hub)."""
