"""Rule-based rewards: a registry of scoring functions, a sandboxed scorer and
DAPO-style dynamic sampling. Imports nothing of the training stack.

* ``registry``: ``REWARD_REGISTRY``, the :func:`register_reward` decorator,
  :func:`resolve_reward` (a registered name or ``"package.module:function"``),
  :func:`check_reward_kwargs` (does a function accept these kwargs) and
  :class:`RewardSpec` (one weighted term of the total reward);
* ``math``: answer extraction and grading (an exact check, then ``math-verify``),
  and the built-in rewards ``math``,
  ``format``, ``dapo_overlong`` and ``length``;
* ``scorer``: :class:`RewardScorer`, a spawn process pool with per-sample
  timeouts and an error policy (``on_error="raise"`` or ``"zero"``);
* ``filters``: :func:`filter_uniform_groups`, DAPO's dynamic sampling;
* ``steps``: :class:`StepScores`, what a step-scored (process-supervision)
  reward returns instead of a float.
"""
from grpo_mega.rewards.filters import GroupFilter, filter_uniform_groups
from grpo_mega.rewards.math import (
    answers_equivalent,
    dapo_overlong_reward,
    extract_answer,
    format_reward,
    length_reward,
    math_reward,
    math_verify_equivalent,
    parse_number,
)
from grpo_mega.rewards.registry import (
    REWARD_REGISTRY, RewardFn, RewardSpec, check_reward_kwargs, register_reward, resolve_reward,
)
from grpo_mega.rewards.scorer import (
    REWARD_BOUND,
    RewardError,
    RewardFailure,
    RewardResult,
    RewardSample,
    RewardScorer,
    score_samples,
)
from grpo_mega.rewards.steps import StepScores

__all__ = [
    "RewardFn", "REWARD_REGISTRY", "register_reward", "resolve_reward", "check_reward_kwargs",
    "RewardSpec", "RewardSample", "RewardFailure", "RewardResult", "RewardError",
    "RewardScorer", "score_samples", "StepScores", "REWARD_BOUND",
    "extract_answer", "parse_number", "answers_equivalent", "math_verify_equivalent",
    "math_reward", "format_reward", "dapo_overlong_reward", "length_reward",
    "GroupFilter", "filter_uniform_groups",
]
