"""Checks that run before any process group starts: the config against the registries
and this machine's hardware, and the per-GPU memory budget of a launch
(``python -m grpo_mega.preflight.budget``)."""
