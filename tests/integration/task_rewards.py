"""Rewards for the learning-direction run (imported by module:function in the reward workers)."""


def starts_with_nine(prompt, completion, reference, metadata=None, **_):
    """1.0 when the completion's first character is '9'. The demo model rarely writes it
    (only sums 90-99 start with 9), so a policy that learns the right way moves this rate
    far above its start within a few steps, and one that learns backwards drives it to 0."""
    return 1.0 if completion.strip().startswith("9") else 0.0


def nine_steps(prompt, completion, reference, metadata=None, **_):
    """Process supervision toy: every character of the completion is a step, scored 1
    when it is '9' (rare under the demo model, so the rate has room to rise)."""
    from grpo_mega.rewards import StepScores

    return StepScores([1.0 if ch == "9" else 0.0 for ch in completion], range(1, len(completion) + 1))


def always_zero(prompt, completion, reference, metadata=None, **_):
    """Every sample scores 0: every group is uniform, so DAPO dynamic sampling finds no
    signal in any round and every step must end as an empty step."""
    return 0.0
