"""The embedded demo (``python -m grpo_mega.demo``): a tiny Qwen2 warm-started on
2-digit addition, then trained with GRPO at TP=2 over gloo with vLLM rollouts."""
