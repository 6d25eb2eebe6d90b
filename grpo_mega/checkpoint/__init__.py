"""Checkpoints: the trainer's own resumable state (model and optimizer through
megatron's distributed checkpointing, resharded on load), HF <-> megatron conversion
with logit verification (``convert``), and loading weights into a model at any layout.
Every write goes to a temporary name and is published by an atomic rename."""
from grpo_mega.checkpoint.trainer_state import (CheckpointError, latest_checkpoint, load_checkpoint,
                                                save_checkpoint)

__all__ = ["CheckpointError", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]
