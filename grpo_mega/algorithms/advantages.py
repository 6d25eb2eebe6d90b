"""Group-relative advantages: outcome (one reward per sample) and process (per step).

* ``group_advantages``: GRPO's z-score over each prompt's G samples, Dr. GRPO
  (no std division) and RLOO (leave-one-out baseline). Baselines and
  normalisations are registered by name in ``BASELINES`` / ``NORMS``.
* ``process_advantages``: DeepSeekMath process supervision (per-step rewards).

Both compute in float64 and return the rewards' float dtype (fp32 for integer rewards):
in float32 a group holding a reward of about 1e20 squared it to inf, so its std was inf and
every advantage of the group silently 0.

``ADVANTAGE_ESTIMATORS`` names the two estimators; ``algorithm.advantage`` in config
is validated against it (``process`` needs rewards that return step scores:
``grpo_mega.rewards.StepScores``).
"""
from __future__ import annotations

from typing import Callable

import torch

from grpo_mega.algorithms._checks import Tensor, _float, _same_shape
from grpo_mega.algorithms.registry import Registry

__all__ = ["group_advantages", "process_advantages", "BASELINES", "NORMS", "ADVANTAGE_ESTIMATORS"]

# baseline(grouped [P, G]) -> [P, G] or [P, 1], subtracted from the rewards
BASELINES: Registry[Callable[[Tensor], Tensor]] = Registry("baseline")
# norm(centred [P, G], grouped [P, G], eps) -> [P, G] advantages
NORMS: Registry[Callable[[Tensor, Tensor, float], Tensor]] = Registry("norm")
# name -> the function that computes those advantages
ADVANTAGE_ESTIMATORS: Registry[Callable[..., Tensor]] = Registry("advantage")


@BASELINES.register("mean")
def _baseline_mean(grouped: Tensor) -> Tensor:
    return grouped.mean(dim=1, keepdim=True)


@BASELINES.register("loo")
def _baseline_loo(grouped: Tensor) -> Tensor:
    # RLOO: each sample's baseline is the mean of the OTHER G-1 samples, so the
    # baseline is independent of the sample and the estimator stays unbiased.
    g = grouped.shape[1]
    return (grouped.sum(dim=1, keepdim=True) - grouped) / (g - 1)


def _group_std(grouped: Tensor) -> Tensor:
    """Sample (Bessel, ddof=1) std per group: [P, G] -> [P, 1]."""
    g = grouped.shape[1]
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred.square().sum(dim=1, keepdim=True) / max(g - 1, 1)).sqrt()


@NORMS.register("std")
def _norm_std(centred: Tensor, grouped: Tensor, eps: float) -> Tensor:
    return centred / (_group_std(grouped) + eps)


@NORMS.register("none")
def _norm_none(centred: Tensor, grouped: Tensor, eps: float) -> Tensor:
    # Dr. GRPO: dividing by the group std up-weights easy/hard (low-variance)
    # prompts; leaving it out removes that question-level difficulty bias.
    return centred


def _check_group_size(group_size, n: int, what: str) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if n % group_size:
        raise ValueError(f"group_size={group_size} does not divide the {n} rows of {what}")
    return group_size


@ADVANTAGE_ESTIMATORS.register("outcome")
def group_advantages(rewards: Tensor, group_size: int, *, norm: str = "std",
                     baseline: str = "mean", eps: float = 1e-6) -> Tensor:
    """Outcome advantages per sample from rewards of G samples per prompt.

    Args:
        rewards: [P*G] scalar reward per sample; each prompt's G samples are
            contiguous (rows g*G .. g*G+G-1 form group g).
        group_size: G, must divide len(rewards).
        norm: "std" (DeepSeekMath GRPO z-score: divide by the group std + eps)
            or "none" (Dr. GRPO: no std division).
        baseline: "mean" (group mean) or "loo" (leave-one-out mean of the
            other G-1 samples, RLOO; needs G >= 2).
        eps: added to the std to keep tiny-variance groups bounded.

    The std is the SAMPLE std (Bessel's ddof=1), like ``torch.std`` as used
    by the reference GRPO implementations (TRL, verl): the paper only writes
    std(r), and matching them keeps published learning rates, clip ranges and
    KL coefficients transferable. Its scale differs from the population std by
    sqrt(G/(G-1)) (e.g. G=2, binary rewards give +-0.707, not +-1).

    Groups whose rewards are all equal (including G=1) carry no learning
    signal and get exactly 0, never NaN or rounding noise divided by eps.

    Returns:
        [P*G] advantages, float (fp32 for integer/bool rewards).
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        raise ValueError("rewards must be a 1-D tensor [num_prompts*group_size]")
    _check_group_size(group_size, rewards.numel(), "rewards")
    base_fn = BASELINES.get(baseline, "baseline")
    norm_fn = NORMS.get(norm, "norm")
    if baseline == "loo" and group_size < 2:
        raise ValueError("group_size must be >= 2 for baseline='loo'")
    r = _float(rewards)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards contain NaN or inf")
    grouped = r.double().view(-1, group_size)  # float64: see the module docstring
    adv = norm_fn(grouped - base_fn(grouped), grouped, eps)
    equal = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    return torch.where(equal, torch.zeros_like(adv), adv).reshape(-1).to(r.dtype)


@ADVANTAGE_ESTIMATORS.register("process")
def process_advantages(step_rewards: Tensor, step_end_index: Tensor, group_size: int,
                       response_len: int, *, eps: float = 1e-6) -> Tensor:
    """Process-supervision GRPO advantages (DeepSeekMath, Sec. 4.1.3).

    Layout (padded, ragged along steps):
        step_rewards:   [B, S] float, reward of step j of response b.
        step_end_index: [B, S] int, token index (0-based, inclusive, within the
            response) of the LAST token of step j; -1 marks padding. In each
            row the real steps come first, non-decreasing and < response_len,
            followed only by -1 (two steps end at the same token when one token
            straddles their boundary in the text; it is credited with both). B = num_prompts * group_size,
            each group's G responses contiguous. S is the max step count; rows
            may have fewer steps (even none).
        response_len:   T, width of the returned per-token tensor.

    Each group's real step rewards are normalised together by their mean and
    sample std (same convention as ``group_advantages``):
    r~ = (r - mean) / (std + eps); all-equal (or single-step) groups give 0.
    A token t then gets A_t = sum of r~_j over steps j with end_j >= t, so
    tokens after a row's last step get 0.

    Returns:
        [B, T] float advantages (fp32 for integer rewards).
    """
    if not isinstance(step_rewards, Tensor) or step_rewards.dim() != 2:
        raise ValueError("step_rewards must be a 2-D tensor [B, S]")
    _same_shape(step_rewards, "step_rewards", step_end_index, "step_end_index")
    if step_end_index.is_floating_point() or step_end_index.dtype == torch.bool:
        raise ValueError(f"step_end_index must be integer, got {step_end_index.dtype}")
    if isinstance(response_len, bool) or not isinstance(response_len, int) or response_len < 1:
        raise ValueError(f"response_len must be a positive int, got {response_len!r}")
    b, s = step_rewards.shape
    _check_group_size(group_size, b, "step_rewards")
    ends = step_end_index.long()
    valid = ends >= 0
    if bool((ends >= response_len).any()) or bool((ends < -1).any()):
        raise ValueError(f"step_end_index must be in [0, response_len={response_len}) or -1 (padding)")
    if s > 1:
        if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
            raise ValueError("step_end_index: padding (-1) must only trail the real steps of a row")
        if bool((valid[:, 1:] & (ends[:, 1:] < ends[:, :-1])).any()):
            raise ValueError("step_end_index must be non-decreasing within a row")
    out_dtype = _float(step_rewards).dtype
    r = step_rewards.double()  # float64: see the module docstring
    if not bool(torch.isfinite(r[valid]).all()):
        raise ValueError("step_rewards contain NaN or inf at real steps")

    # Normalise over all real steps of the group: [P, G*S].
    r0 = torch.where(valid, r, torch.zeros_like(r))
    gr, gv = r0.view(-1, group_size * s), valid.view(-1, group_size * s)
    count = gv.sum(dim=1, keepdim=True)
    mean = gr.sum(dim=1, keepdim=True) / count.clamp(min=1)
    dev = torch.where(gv, gr - mean, torch.zeros_like(gr))
    std = (dev.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    big = torch.finfo(r.dtype).max
    equal = (torch.where(gv, gr, -big).amax(dim=1, keepdim=True)
             == torch.where(gv, gr, big).amin(dim=1, keepdim=True)) | (count <= 1)
    normed = torch.where(equal | ~gv, torch.zeros_like(dev), dev / (std + eps)).view(b, s)

    # A_t = sum_{j: end_j >= t} r~_j: drop each r~_j at its end token, then a
    # reverse cumulative sum over tokens. O(B*T), no [B, S, T] intermediate.
    at_end = torch.zeros(b, response_len, dtype=r.dtype, device=r.device)
    at_end.scatter_add_(1, ends.clamp(min=0), normed)
    return at_end.flip(1).cumsum(1).flip(1).to(out_dtype)

