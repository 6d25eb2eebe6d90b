"""GRPO math: vocab-parallel log-probs, entropy and KL; advantages; the loss.

Pure functions for one GRPO update, written for Megatron tensor parallelism,
where each rank holds a slice of the vocabulary (``logits: [..., V/tp]``).
Process groups are arguments (``tp_group=None`` means a single rank); nothing
here reads megatron's global state. Bad input raises ValueError naming the
argument, before any collective can hang.

* ``vocab_parallel``: exact ``vocab_parallel_logprobs`` / ``_entropy`` / ``_kl``
  from vocab shards with analytic backwards (``vocab_parallel_triton``: the
  fused Triton kernel for log-probs + entropy);
* ``advantages``: ``group_advantages`` (GRPO z-score, Dr. GRPO, RLOO) and
  ``process_advantages`` (DeepSeekMath process supervision);
* ``kl``: ``kl_penalty`` (k1/k2/k3/abs sample estimators) and ``exact_kl``
  (``full``: the exact KL over the vocabulary from both policies' logits shards);
* ``off_policy``: the off-policy objectives (``OFF_POLICY``: ``decoupled``, AReaL's
  decoupled PPO, and ``behaviour``), ``importance_weight``, and which log-prob passes an
  objective needs (``proximal_pass_needed``, ``behaviour_logp_needed``);
* ``loss``: ``policy_loss`` (clipped surrogate + KL + TIS; GRPO's per-token or
  GSPO's per-sequence ratio), ``aggregate`` (loss
  reduction modes) and ``global_batch_counts`` (the global normalisation
  contract for micro-batches and data parallelism is documented there).

Variants (advantage estimators, baselines and normalisations, KL estimators,
aggregation modes, policy-loss ratios, off-policy objectives) are registered by decorator
in ``registry.Registry`` instances; config validation reads their ``.names()``.
"""
from grpo_mega.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    BASELINES,
    NORMS,
    group_advantages,
    process_advantages,
)
from grpo_mega.algorithms.kl import (KL_ALIASES, KL_ESTIMATORS, KLEstimator, exact_kl,
                                     kl_needs_logits, kl_penalty)
from grpo_mega.algorithms.loss import AGGREGATIONS, POLICY_LOSSES, aggregate, global_batch_counts, policy_loss
from grpo_mega.algorithms.off_policy import (OFF_POLICY, behaviour_correction, behaviour_logp_needed,
                                             importance_weight, proximal_pass_needed)
from grpo_mega.algorithms.registry import Registry
from grpo_mega.algorithms.vocab_parallel import (
    vocab_parallel_entropy,
    vocab_parallel_kl,
    vocab_parallel_logprobs,
)

__all__ = [
    "vocab_parallel_logprobs",
    "vocab_parallel_entropy",
    "vocab_parallel_kl",
    "group_advantages",
    "process_advantages",
    "kl_penalty",
    "exact_kl",
    "kl_needs_logits",
    "KLEstimator",
    "aggregate",
    "global_batch_counts",
    "policy_loss",
    "Registry",
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "KL_ALIASES",
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "OFF_POLICY",
    "behaviour_correction",
    "importance_weight",
    "proximal_pass_needed",
    "behaviour_logp_needed",
    "BASELINES",
    "NORMS",
]
