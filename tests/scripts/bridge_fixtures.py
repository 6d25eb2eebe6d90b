"""Tiny random HF checkpoints for the bridge / conversion tests and the benchmark.

Built here with transformers (not ``grpo_mega.testing.tiny``) so these tests do not move
with the demo's model builder. head_dim is 32, the smallest vLLM's CPU attention
accepts. Weights are seeded per tensor name, and norms are random too, so a
mapping mistake in any tensor shows.

    hf_dir = write_hf_checkpoint(tmp / "llama", "llama", tie=False)
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

VARIANTS = {
    # name: (family, tie_word_embeddings); qwen2 always has a QKV bias
    "llama_tied": ("llama", True),
    "llama_untied": ("llama", False),
    "qwen2_bias": ("qwen2", True),
}


def write_hf_checkpoint(out_dir, family: str, *, tie: bool, vocab_size: int = 300,
                        hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                        num_kv_heads: int = 2, intermediate_size: int = 192, seed: int = 0,
                        std: float = 0.05, max_position_embeddings: int = 256,
                        rope_scaling: dict | None = None, moe: dict | None = None) -> Path:
    """Write config.json + model.safetensors of a random ``family`` model; returns the dir.
    ``rope_scaling`` is HF's dict (``{"rope_type": "llama3", ...}``). ``qwen3_moe`` takes
    ``moe`` (HF names: num_experts, num_experts_per_tok, moe_intermediate_size,
    norm_topk_prob); its router weights get std 1 so that top-k choices are not near ties."""
    import transformers

    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}[family]
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  intermediate_size=intermediate_size, tie_word_embeddings=tie,
                  max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = dict(rope_scaling)
    if family in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = hidden_size // num_heads
    if family == "qwen3_moe":
        kwargs.update(dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           norm_topk_prob=True), **(moe or {}))
    config = getattr(transformers, cls + "Config")(**kwargs)
    model = getattr(transformers, cls + "ForCausalLM")(config).to(torch.float32)
    with torch.no_grad():
        seen = set()
        for name, p in sorted(model.named_parameters()):
            if id(p) in seen:
                continue
            seen.add(id(p))
            g = torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(name.encode()))
            base = 1.0 if "norm" in name else 0.0
            scale = 1.0 if name.endswith("mlp.gate.weight") else std
            p.copy_(base + scale * torch.randn(p.shape, generator=g))
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "float32"  # vLLM's dtype="auto" reads this
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def read_hf_tensors(hf_dir) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint (single file or sharded)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
