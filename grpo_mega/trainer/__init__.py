"""The GRPO trainer: the ``Trainer`` that holds a run's parts (built once), the
step's stages (rollout, reward, advantage, log-probs, update, sync, log, checkpoint),
the per-step training batch and the metrics sink. Only ``grpo_mega.train`` and the
demo import this package."""
