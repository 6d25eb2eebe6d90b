"""Tiny Hugging Face checkpoints for tests, the demo and the weight bridge.

What: :func:`build_tiny_hf_checkpoint` writes a transformers-format
checkpoint (``config.json``, ``model.safetensors``, ``generation_config.json``
and, when given, the tokenizer files) of a randomly initialised Qwen2, Llama or Qwen3-MoE
model that both transformers and vLLM load offline.

Why: the HF hub is unreachable here, so every test model is built locally.
The weights are drawn from a generator seeded by ``seed`` in sorted-name
order, independent of transformers' own init, so the same arguments give the
same tensors on every machine and transformers version.

Constraints that come from vLLM (checked here, before vLLM sees them):
* ``hidden_size / num_heads`` (head_dim) must be >= 32: vLLM's CPU attention
  backend rejects 16. vLLM's Qwen2 also ignores ``config.head_dim``, so
  head_dim is always ``hidden_size // num_heads``.
* vLLM's Qwen2 always has q/k/v biases, so ``family="qwen2"`` requires
  ``qkv_bias=True``. For Llama, ``qkv_bias`` maps to ``attention_bias``,
  which in HF and vLLM also adds an o_proj bias.

The signature is used by the weight bridge, the conversion tools and the
demo: keep it stable (add keyword arguments only at the end).

How to run::

    .venv/bin/python -c "from grpo_mega.testing.tiny import build_tiny_hf_checkpoint as b; print(b('/tmp/tiny'))"
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

__all__ = ["build_tiny_hf_checkpoint", "build_tiny_tokenizer", "default_corpus", "FAMILIES",
           "MIN_HEAD_DIM", "TINY_CHAT_TEMPLATE", "TOKENIZER_FILES"]

MIN_HEAD_DIM = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
# family -> (transformers config class, model class) names
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


# A ChatML-style template (Qwen's turn markers) so chat-formatted prompt rows can
# be tested end to end; the markers are plain text to the tiny vocab.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_hf_checkpoint(
    out_dir: str | os.PathLike,
    family: str = "qwen2",
    vocab_size: int | None = None,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool | None = None,
    qkv_bias: bool | None = None,
    rope_theta: float = 10000.0,
    tokenizer_dir: str | os.PathLike | None = None,
    seed: int = 0,
    *,
    max_position_embeddings: int = 2048,
    rms_norm_eps: float = 1e-6,
    init_std: float = 0.02,
    moe: dict | None = None,
    router_init_std: float = 1.0,
) -> Path:
    """Write a random tiny causal LM to ``out_dir``; returns ``out_dir``.

    Args:
        family: "qwen2", "llama", "qwen3" or "qwen3_moe" (Qwen3: QK-norm, no biases; MoE: every
            layer routed; head_dim = hidden_size // num_heads).
        vocab_size: defaults to the tokenizer's size (``len(tokenizer)``) when
            ``tokenizer_dir`` is given, else 512. May exceed the tokenizer's
            size (padding rows), never be smaller.
        intermediate_size: SwiGLU width; defaults to ``4 * hidden_size``.
        tie_word_embeddings: defaults to True for qwen2 (like the small
            Qwen2 models) and False for llama.
        qkv_bias: defaults to True for qwen2 (required there) and False for llama.
        rope_theta: RoPE base.
        tokenizer_dir: an HF tokenizer directory (e.g. from
            ``grpo_mega.data.tokenizer.write_hf_tokenizer_dir``) copied next to the
            weights; its bos/eos/pad ids go into the config. Without it, the
            ids of ``train_sentencepiece`` tokenizers are assumed (bos=1,
            eos=2, pad=3).
        seed: all weights are a function of (seed, shapes, names).
        init_std: std of the normal init of matrices and biases (norm
            weights are 1). Larger values give peakier, less uniform outputs.
        moe: ``qwen3_moe`` only, HF names: ``num_experts``, ``num_experts_per_tok``,
            ``moe_intermediate_size``, ``norm_topk_prob`` (defaults 4, 2, 2 x hidden, true).
        router_init_std: std of the MoE routers' normal init. The default 1 keeps top-k
            choices away from near ties that the engine's and megatron's float orders could
            break differently (tests); a small one (the demo's) starts from near-uniform routing.
    """
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}; choose one of {sorted(FAMILIES)}")
    tie = (family == "qwen2") if tie_word_embeddings is None else bool(tie_word_embeddings)
    bias = (family == "qwen2") if qkv_bias is None else bool(qkv_bias)
    _check_shapes(family, hidden_size, num_heads, num_kv_heads, bias)
    special = _special_ids(tokenizer_dir)
    vocab_size = _vocab_size(vocab_size, tokenizer_dir)

    import transformers

    config_cls = getattr(transformers, FAMILIES[family][0])
    model_cls = getattr(transformers, FAMILIES[family][1])
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size or 4 * hidden_size, hidden_act="silu",
        max_position_embeddings=max_position_embeddings, rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie, initializer_range=init_std, torch_dtype="float32",
        **special, **_rope_kwargs(rope_theta),
    )
    if family == "llama":
        kwargs["attention_bias"] = bias
    if family in ("qwen3", "qwen3_moe"):
        kwargs.update(head_dim=hidden_size // num_heads, attention_bias=False)
    if family == "qwen3_moe":
        kwargs.update(dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=2 * hidden_size,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]), **(moe or {}))
    elif moe:
        raise ValueError(f"moe={moe} needs family='qwen3_moe', got {family!r}")
    config = config_cls(**kwargs)
    model = model_cls(config).to(torch.float32)
    _init_weights(model, seed, init_std, router_init_std)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    _fix_config_dtype(out / "config.json")
    if tokenizer_dir is not None:
        _copy_tokenizer(Path(tokenizer_dir), out)
        _check_tokenizer_loads_as_written(Path(tokenizer_dir), out, family)
    return out


def default_corpus() -> list[str]:
    """A small built-in corpus: arithmetic, math answer formats, English."""
    texts = [f"What is {a} + {b}? The answer is {a + b}. #### {a + b}"
             for a in range(0, 100, 3) for b in range(0, 100, 7)]
    texts += [f"Compute {a} * {b}. \\boxed{{{a * b}}}" for a in range(13) for b in range(13)]
    texts += ["The quick brown fox jumps over the lazy dog.",
              "Question: how many apples are left?\nAnswer: 1,234 apples, or \\frac{1}{2} of them.",
              "Let's think step by step. First, add the numbers; then check the result."]
    return texts


def build_tiny_tokenizer(out_dir: str | os.PathLike, family: str = "qwen2",
                         texts: list[str] | None = None, vocab_size: int = 512,
                         chat_template: str | None = TINY_CHAT_TEMPLATE) -> Path:
    """An HF tokenizer directory that loads correctly for ``family``.

    qwen2: byte-level BPE (``train_bpe_tokenizer``); transformers 5 forces
    Qwen2's own pipeline on a qwen2 checkpoint, so a sentencepiece-style
    tokenizer would encode garbage there. llama: sentencepiece
    (``train_sentencepiece`` + ``write_hf_tokenizer_dir``; the ``.model``
    is kept as ``<out_dir>/sp.model``). The actual vocab may be smaller than
    ``vocab_size`` when the corpus is small. Special ids: unk=0, bos=1,
    eos=2, pad=3. ``chat_template`` (default :data:`TINY_CHAT_TEMPLATE`) goes
    into ``tokenizer_config.json``, as in an instruct model; None leaves it out.
    """
    from grpo_mega.data.tokenizer import train_bpe_tokenizer, train_sentencepiece, write_hf_tokenizer_dir

    if family not in FAMILIES:
        raise ValueError(f"family={family!r}; choose one of {sorted(FAMILIES)}")
    texts = default_corpus() if texts is None else list(texts)
    out = Path(out_dir)
    if family == "qwen2":
        return train_bpe_tokenizer(texts, out, vocab_size, chat_template=chat_template)
    out.mkdir(parents=True, exist_ok=True)
    sp_model = train_sentencepiece(texts, out / "sp", vocab_size)
    return write_hf_tokenizer_dir(sp_model, out, chat_template=chat_template)


def _check_shapes(family: str, hidden: int, heads: int, kv_heads: int, bias: bool) -> None:
    if hidden % heads:
        raise ValueError(f"hidden_size={hidden} is not divisible by num_heads={heads}")
    head_dim = hidden // heads
    if head_dim < MIN_HEAD_DIM:
        raise ValueError(f"head_dim = hidden_size/num_heads = {head_dim} < {MIN_HEAD_DIM}: vLLM's "
                         "CPU attention backend rejects it; use fewer heads or a wider model")
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} is not divisible by num_kv_heads={kv_heads}")
    if family in ("qwen3", "qwen3_moe") and bias:
        raise ValueError(f"{family} has no q/k/v biases (qkv_bias=True)")
    if family == "qwen2" and not bias:
        raise ValueError("qwen2 requires qkv_bias=True (vLLM's Qwen2 always has q/k/v biases)")


def _special_ids(tokenizer_dir: str | os.PathLike | None) -> dict[str, int]:
    if tokenizer_dir is None:
        from grpo_mega.data.tokenizer import SPECIAL_PIECES

        return {f"{k}_token_id": SPECIAL_PIECES[k][0] for k in ("bos", "eos", "pad")}
    from grpo_mega.data.tokenizer import HFTokenizer

    tok = HFTokenizer(tokenizer_dir)
    ids = {"eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    if tok.bos_id is not None:
        ids["bos_token_id"] = tok.bos_id
    return ids


def _vocab_size(vocab_size: int | None, tokenizer_dir: str | os.PathLike | None) -> int:
    if tokenizer_dir is None:
        return 512 if vocab_size is None else int(vocab_size)
    from grpo_mega.data.tokenizer import HFTokenizer

    n = HFTokenizer(tokenizer_dir).vocab_size
    if vocab_size is None:
        return n
    if vocab_size < n:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {n} tokens")
    return int(vocab_size)


def _rope_kwargs(rope_theta: float) -> dict:
    # transformers 5 moved rope_theta into rope_parameters; 4.x takes it flat.
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)}}
    return {"rope_theta": float(rope_theta)}


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int, std: float, router_std: float = 1.0) -> None:
    """Deterministic init in sorted-name order (tied weights are drawn once)."""
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if id(param) in seen:
            continue
        seen.add(id(param))
        if "norm" in name:
            param.fill_(1.0)
        elif name.endswith("mlp.gate.weight"):  # an MoE router
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * router_std)
        else:
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)


def _fix_config_dtype(path: Path) -> None:
    # vLLM's dtype="auto" reads this field; keep it float32 explicitly
    # (transformers 5 writes "dtype", 4.x "torch_dtype").
    cfg = json.loads(path.read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _copy_tokenizer(src: Path, out: Path) -> None:
    copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
        raise FileNotFoundError(f"tokenizer_dir {src} has neither tokenizer.json nor tokenizer.model")
    for f in copied:
        shutil.copyfile(src / f, out / f)


def _check_tokenizer_loads_as_written(tokenizer_dir: Path, out: Path, family: str) -> None:
    """AutoTokenizer on the checkpoint must tokenize like the tokenizer dir.

    transformers 5 picks the tokenizer class from the model type for some
    families (qwen2 among them) and rebuilds the pipeline, so a tokenizer
    that is fine on its own can turn into garbage inside a checkpoint. The
    probe is the text of the tokenizer's own (non-special) vocabulary, so a
    small tokenizer (e.g. digits only) is judged on what it can encode.
    """
    from grpo_mega.data.tokenizer import HFTokenizer

    alone, inside = HFTokenizer(tokenizer_dir), HFTokenizer(out)
    special = set(alone.hf.all_special_ids)
    probe = alone.decode([i for i in range(alone.vocab_size) if i not in special])
    if alone.encode(probe) != inside.encode(probe) or inside.decode(inside.encode(probe)) != probe:
        raise ValueError(
            f"the tokenizer in {tokenizer_dir} changes behaviour inside a {family} checkpoint "
            f"(transformers loads it as {type(inside.hf).__name__}); build it with "
            f"grpo_mega.testing.tiny.build_tiny_tokenizer(out_dir, family={family!r})")
