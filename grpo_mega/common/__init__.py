"""Two small leaves shared across parts: importing a configured ``"package.module:attr"``
name (rewards, environments, chat formats) and streaming a safetensors file (the
checkpoint converter and the rollout engine's weight files).

Imports nothing of ours, so the rollout side can use it without the training stack.
"""
