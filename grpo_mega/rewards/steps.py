"""Per-step rewards for process supervision (DeepSeekMath 4.1.3).

A reward function that scores the steps of a response, rather than the response
as a whole, returns :class:`StepScores` instead of a float. Steps are spans of
the completion TEXT, given by their exclusive character end offsets: step ``j``
is ``completion[ends[j-1]:ends[j]]`` (step 0 starts at 0). Text offsets keep a
reward free of tokenizers; the trainer maps each end to the response token that
completes that character (``grpo_mega.trainer.steps``).

Used with ``algorithm.advantage=process``; every reward term must then return
StepScores (several terms must share their step ends and are weighted and
summed per step), and with ``outcome`` none may.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["StepScores"]


@dataclass(frozen=True)
class StepScores:
    """Scores of the steps of one completion (plain data: crosses the scoring pool's pipes)."""

    scores: tuple[float, ...]
    """Reward of each step, in order."""
    ends: tuple[int, ...]
    """Exclusive character end offset of each step in the completion: strictly increasing,
    in [1, len(completion)]. Text after the last end belongs to no step (its tokens get
    advantage 0)."""

    def __init__(self, scores: Sequence[float], ends: Sequence[int]):
        object.__setattr__(self, "scores", tuple(float(s) for s in scores))
        object.__setattr__(self, "ends", tuple(int(e) for e in ends))

    @property
    def value(self) -> float:
        """The sample's scalar reward for metrics and evaluation: the mean step score
        (0 with no steps), so 0/1 step scores give 1 only when every step is right."""
        return sum(self.scores) / len(self.scores) if self.scores else 0.0

    def check(self, completion_len: int) -> None:
        """ValueError unless the steps are well formed for a completion of this length."""
        if len(self.scores) != len(self.ends):
            raise ValueError(f"StepScores has {len(self.scores)} scores but {len(self.ends)} ends")
        if not all(math.isfinite(s) for s in self.scores):
            raise ValueError(f"StepScores has non-finite scores {self.scores}")
        prev = 0
        for e in self.ends:
            if not prev < e <= completion_len:
                raise ValueError(f"StepScores ends {self.ends} must be strictly increasing "
                                 f"character offsets in [1, {completion_len}] (the completion's length)")
            prev = e
