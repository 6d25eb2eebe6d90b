"""Checkpoints: the trainer's own resumable state (model and optimizer through
megatron's distributed checkpointing, resharded on load), HF <-> megatron conversion
(``convert``), loading HF or converted weights into a model at any layout (also in
``convert``), HF files (``hf_files``), logit verification (``verify``), and the I/O they
share (``io``: the one ``CheckpointError``, atomic publish by rename)."""
from grpo_mega.checkpoint.io import CheckpointError
from grpo_mega.checkpoint.trainer_state import latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]
