"""The iterative-GRPO reference reset (``stages.reset_reference``) copies the policy."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from grpo_mega.trainer.stages import reset_reference


def _trainer(step: int, every: int):
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    cfg = SimpleNamespace(algorithm=SimpleNamespace(ref_reset_every=every))
    return SimpleNamespace(model=model, ref=ref, step=step, cfg=cfg, ref_reset_step=None)


def test_reference_reset_copies_the_policy_and_never_aliases_it():
    """Guards against a reset that makes the reference share the policy's tensors (a
    ``load_state_dict(..., assign=True)`` or a parameter swap): the reference would then
    move with every later optimizer step, and the KL would measure the policy against
    itself (0). After the reset the reference equals the policy; after an in-place update
    of the policy (what the optimizer does) it keeps the reset's values. Off-schedule
    steps leave the reference alone."""
    t = _trainer(step=3, every=2)
    before = {k: v.clone() for k, v in t.ref.state_dict().items()}
    assert reset_reference(t) is False and t.ref_reset_step is None
    for k, v in t.ref.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)

    t.step = 4
    assert reset_reference(t) is True and t.ref_reset_step == 4
    policy = {k: v.clone() for k, v in t.model.state_dict().items()}
    for k, v in t.ref.state_dict().items():
        torch.testing.assert_close(v, policy[k], rtol=0, atol=0)
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(1.0)
    for k, v in t.ref.state_dict().items():
        torch.testing.assert_close(v, policy[k], rtol=0, atol=0, msg=f"{k} moved with the policy")
