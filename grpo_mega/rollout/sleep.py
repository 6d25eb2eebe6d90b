"""The rollout engine's memory phases on a colocated GPU (vLLM sleep mode).

The sequence an RL engine uses, once per step (README "GPU"):

    release()          vLLM sleep level 2: weights and KV cache discarded (the sync
                       overwrites every weight, so offloading them would be waste)
    ... log-probs and the update run in the freed memory ...
    wake_weights()     torch's CUDA cache emptied, then only the weights' memory mapped back
    ... the sync loads the weights ...
    wake_kv_cache()    then the KV cache

On CPU vLLM has no sleep mode: each call is a recorded no-op, and the order is visible
in ``calls`` (tests/integration/test_memory_phases.py).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("grpo_mega.rollout.engine")


def free_torch_cache() -> int:
    """Return torch's cached, unused CUDA blocks to the driver (0 on CPU); bytes freed."""
    if not torch.cuda.is_available():
        return 0
    import gc

    gc.collect()
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return before - torch.cuda.memory_reserved()


class SleepPhases:
    """Mixed into ``RolloutEngine``: needs ``llm``, ``config.colocate``, ``on_cpu``,
    ``holds_engine``, ``calls``, ``releases``/``resumes``, ``memory_released``, ``_asleep``
    and ``_weights_stale``, ``_finish_update``."""

    def release(self) -> None:
        """Free accelerator memory for the training phase (vLLM sleep level 2, colocate=True
        on GPU): weights and KV cache are discarded, not offloaded, since the sync overwrites
        every weight (level 1 copied them to pinned host memory and back for nothing: 16 GiB
        per GPU for 70B at TP 8). Wake with ``wake_weights``, sync, then ``wake_kv_cache``.
        Otherwise a recorded no-op: ``releases`` counts the calls, ``memory_released`` stays False."""
        self.releases += 1
        self.calls.append("release")
        if self._sleep_unsupported("release"):
            return
        self._finish_update()  # an open reload must not sleep with half its layers on meta
        self.llm.sleep(level=2)
        self.memory_released = True
        self._asleep = {"weights", "kv_cache"}
        self._weights_stale = True

    def wake_weights(self) -> None:
        """Map the weights' memory back (garbage until the sync loads them), after emptying
        torch's CUDA cache: vLLM's allocator maps fresh memory and cannot reuse what torch's
        caching allocator still holds from the update (activations, logits)."""
        self.calls.append("empty_cache")
        free_torch_cache()
        self.calls.append("wake_weights")
        if self._sleep_unsupported("wake_weights") or "weights" not in self._asleep:
            return
        self.llm.wake_up(tags=["weights"])
        self._asleep.discard("weights")

    def wake_kv_cache(self) -> None:
        """Map the KV cache back, after the sync (the sync's buffers are freed by then)."""
        self.calls.append("wake_kv_cache")
        if self._sleep_unsupported("wake_kv_cache") or "kv_cache" not in self._asleep:
            return
        self.llm.wake_up(tags=["kv_cache"])
        self._asleep.discard("kv_cache")
        self.memory_released = bool(self._asleep)

    def resume(self) -> None:
        """Everything awake before rollouts; refuses weights that a level-2 sleep discarded
        and no sync has loaded since (the engine would sample from garbage)."""
        self.resumes += 1
        self.calls.append("resume")
        if self._sleep_unsupported("resume") or not self.memory_released:
            return
        if "weights" in self._asleep:
            self.wake_weights()
        if self._weights_stale:
            raise RuntimeError("rollout: the engine's weights were discarded by release() (vLLM sleep "
                               "level 2) and no sync loaded them; call wake_weights(), sync, then "
                               "wake_kv_cache() (trainer/stages.py resume_engine and sync)")
        self.wake_kv_cache()

    def _sleep_unsupported(self, what: str) -> bool:
        if not self.holds_engine:
            return True
        if self.on_cpu:
            log.info("rollout: %s skipped: vLLM has no sleep mode on CPU", what)
            return True
        if not self.config.colocate:
            log.info("rollout: %s skipped: engine built with colocate=False", what)
            return True
        return False
