"""Measure the MoE weight sync into vLLM: log-prob gaps to transformers (the numbers in docs/guides/moe.md).

A tiny Qwen3-MoE (4 experts, top-2) is served by an in-process RolloutEngine built on
checkpoint A; different weights B (another seed) are then loaded three ways, each on a
fresh engine: the engine's own ``update_weights`` (experts re-prepacked), vLLM's plain
``reload_weights`` (experts left in checkpoint layout), and plain ``reload_weights``
with the experts split over two updates. Prints max |vLLM - transformers| of the
prompt log-probs against A and B, and the bridge verification's verdict.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python tests/scripts/moe_sync_gap.py
"""
from __future__ import annotations

import os
import sys
import tempfile

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")

import torch  # noqa: E402

SEQ = [5, 17, 42, 99, 7, 3, 250, 11, 64, 2]


def _hf_logprobs(hf_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = model(torch.tensor([SEQ])).logits.float().log_softmax(-1)[0, :-1]
    return logp.gather(-1, torch.tensor(SEQ[1:])[:, None])[:, 0]


def _engine_logprobs(llm) -> torch.Tensor:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=SEQ)], params, use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][SEQ[i]].logprob for i in range(1, len(SEQ))])


def main() -> None:
    from grpo_mega.bridge.verify import make_probe, verify_engine
    from grpo_mega.checkpoint.convert import read_model_config
    from grpo_mega.rollout import EngineConfig, RolloutEngine
    from tests.scripts.bridge_fixtures import read_hf_tensors, write_hf_checkpoint

    root = tempfile.mkdtemp(prefix="moe_sync_gap_")
    a = write_hf_checkpoint(f"{root}/a", "qwen3_moe", tie=False, seed=5)
    b = write_hf_checkpoint(f"{root}/b", "qwen3_moe", tie=False, seed=6)
    cfg, new = read_model_config(b), read_hf_tensors(b)
    ref_a, ref_b = _hf_logprobs(a), _hf_logprobs(b)
    half = {n for n in new if ".mlp.experts." in n and int(n.split(".mlp.experts.")[1].split(".")[0]) < 2}
    ways = {
        "update_weights": lambda e: e.update_weights(list(new.items())),
        "plain reload_weights": lambda e: e.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": list(new.items())}),
        "plain reload_weights, experts in 2 updates": lambda e: [e.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": part}) for part in (
            [(n, t) for n, t in new.items() if n not in half],
            [(n, t) for n, t in new.items() if n in half])],
    }
    for way, update in ways.items():
        engine = RolloutEngine(EngineConfig(str(a), mode="inprocess", max_model_len=64, warmup=False,
                                            extra={"skip_tokenizer_init": True}))
        fresh = float((_engine_logprobs(engine.llm) - ref_a).abs().max())
        update(engine)
        engine.reset_prefix_cache()
        lp = _engine_logprobs(engine.llm)
        probes = {n: make_probe(n, t, cfg, 2, 1) for n, t in new.items()}
        problems = verify_engine(engine, probes)
        print(f"{way}: fresh engine vs A {fresh:.2g}; after loading B: vs B "
              f"{float((lp - ref_b).abs().max()):.2g}, vs A {float((lp - ref_a).abs().max()):.2g}; "
              f"verification: {'passes' if not problems else f'{len(problems)} mismatches'}", flush=True)
        engine.shutdown()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


if __name__ == "__main__":
    sys.exit(main())
