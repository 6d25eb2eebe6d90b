"""The budget's dense activation estimate (``preflight.budget.activation_bytes``) against
the activations a real megatron-core GPTModel keeps for its backward.

The reference is measured, not derived from the estimate: every tensor autograd saves
during the forward passes through ``torch.autograd.graph.saved_tensors_hooks``; the ones
saved inside a decoder layer (parameters excepted) are counted once per storage, so views
and tensors saved by two ops count once, as they occupy memory once. That count is exact
and deterministic, unlike a profiler's peak.
"""
from __future__ import annotations

import pytest
import torch

H, HEADS, KV, FFN, LAYERS = 64, 4, 2, 160, 2
HD = H // HEADS
VOCAB = 64


def _saved_bytes_in_layers(model, b: int, s: int) -> int:
    """Bytes of the distinct storages autograd saves inside the decoder layers in one
    forward of a [b, s] batch (parameters excluded)."""
    from grpo_mega.models.gpt import forward_logits

    inside = [0]
    hooks = []
    for layer in model.decoder.layers:
        hooks.append(layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, inside[0] + 1)))
        hooks.append(layer.register_forward_hook(lambda *_: inside.__setitem__(0, inside[0] - 1)))
    storages: dict[int, int] = {}

    def pack(t):
        if inside[0] and not isinstance(t, torch.nn.Parameter):
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        return t

    tokens = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(b * 100 + s))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = forward_logits(model, tokens)
    finally:
        for h in hooks:
            h.remove()
    del logits
    return sum(storages.values())


@pytest.fixture
def tiny_dense_model():
    """A 2-layer GQA GPTModel (local spec, fp32, tp=1) in a one-rank gloo world."""
    if torch.cuda.is_available():
        pytest.skip("the implementation terms below are the CPU local spec's; a GPU may pick "
                    "Transformer Engine's fused layers, which save other tensors")
    import torch.distributed as dist

    from grpo_mega.config import load_config
    from grpo_mega.distributed import cpu_compat
    from grpo_mega.distributed.state import free_port, init_parallel
    from grpo_mega.models import build_model
    from megatron.core import parallel_state as mpu

    cpu_compat.apply()
    cfg = load_config(None, [f"--model.vocab_size={VOCAB}", f"--model.hidden_size={H}",
                             f"--model.num_attention_heads={HEADS}", f"--model.num_query_groups={KV}",
                             f"--model.ffn_hidden_size={FFN}", f"--model.num_layers={LAYERS}",
                             "--model.make_vocab_size_divisible_by=4", "--model.dtype=float32"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ps = init_parallel(1, 1, seed=3)
        yield cfg, build_model(cfg.model, ps)
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


def test_dense_activation_estimate_matches_the_tensors_megatron_saves(tiny_dense_model):
    """Guards against a wrong dense activation estimate (a term dropped, doubled or of the
    wrong size: the norm inputs, q/k/v with its GQA kv heads, the attention output, fc1 and
    SwiGLU outputs, the layer count), which so far was tested only as ratios of its own
    output, so a bug common to all of them passed.

    Measured per token and layer, with a fit that removes what does not scale with the
    batch: the two-batch difference at each sequence length drops what one sequence shares
    (RoPE's cos/sin, the causal mask), and two lengths separate the per-token part
    ``alpha`` from the ``[b, heads, s, s]`` softmax probabilities (``beta s^2``) that the
    estimate leaves out on purpose (flash attention keeps no scores).

    ``alpha`` must equal the estimate plus, exactly, what megatron's CPU local spec keeps
    beyond the fused GPU kernels the estimate models (each verified by listing the saved
    shapes), per token and layer:
    * RMSNorm, composed of torch ops: the normalised input kept for the weight's gradient
      (``h`` per norm, 2 norms) and its fp32 ``rstd`` (1 per norm); a fused norm keeps
      neither beyond the input the estimate counts;
    * unfused core attention: k and v expanded from ``kv`` to all ``heads`` query heads
      before the batched matmuls (``2 (heads - kv) head_dim``);
    * unfused SwiGLU: ``silu(gate)`` and ``up + glu_linear_offset`` (``2 ffn``), which a
      fused SwiGLU recomputes from the fc1 output the estimate already counts.
    The scores term must be exactly the fp32 probabilities, 4 bytes x heads per s^2. And the
    budget's activations row must be the measured bytes less those extras, times the tokens
    of a micro-batch (a dtype or token factor lost between estimate and row)."""
    from grpo_mega.preflight.budget import GiB, activation_bytes, derive_layout, memory_budget

    cfg, model = tiny_dense_model
    m = cfg.model
    per_b = {s: _saved_bytes_in_layers(model, 2, s) - _saved_bytes_in_layers(model, 1, s) for s in (8, 12)}
    beta = (per_b[12] / 12 - per_b[8] / 8) / (12 - 8)  # bytes per s^2 per sequence
    alpha = per_b[8] / 8 - beta * 8  # bytes per token
    assert beta == 4 * HEADS * LAYERS, (beta, per_b)
    local_extras = 2 * H + 2 + 2 * (HEADS - KV) * HD + 2 * FFN  # elements per token and layer
    estimate = activation_bytes(m, tp=1, pp=1, inflight=1)  # elements per token, all layers
    assert alpha / 4 == estimate + local_extras * LAYERS, (
        f"measured {alpha / 4} saved elements per token over {LAYERS} layers; the estimate "
        f"{estimate} plus the local spec's {local_extras} a layer gives "
        f"{estimate + local_extras * LAYERS}")
    # The estimate by hand for this shape, to show the size of each term the test resolves:
    # 4h norm-side + (heads + 2 kv) hd q/k/v + heads hd attention output + 3 ffn SwiGLU.
    assert estimate == (4 * H + (HEADS + 2 * KV) * HD + HEADS * HD + 3 * FFN) * LAYERS
    layout = derive_layout(cfg, 1)
    row = memory_budget(cfg, layout).row("activations") * GiB
    expected = (alpha - 4 * local_extras * LAYERS) * cfg.parallel.micro_batch_size * layout.seq_len
    assert row == pytest.approx(expected, rel=1e-12), (row, expected)


def test_packing_budget_counts_activations_from_the_token_budget():
    """Guards the memory budget under ``parallel.max_tokens_per_micro_batch``: activations and
    logits counted for ``micro_batch_size`` full-length rows instead of the token budget a
    packed micro-batch holds, and the micro-batches in flight (1F1B) from the row count, not
    from the most micro-batches the budget can make (every row at full length); the
    ``--check-config`` report names the budget."""
    from grpo_mega.config import load_config
    from grpo_mega.preflight import budget as B

    base = ["--parallel.pp=2", "--parallel.micro_batch_size=64", "--data.max_prompt_tokens=100",
            "--rollout.max_new_tokens=28", "--data.prompts_per_step=8", "--rollout.n=8"]
    rows = load_config(None, base)
    packed = load_config(None, [*base, "--parallel.packing=true", "--parallel.max_tokens_per_micro_batch=300"])
    lr, lp = B.derive_layout(rows, 2), B.derive_layout(packed, 2)
    assert (lr.micro_batches, lp.micro_batches) == (1, 32)  # 64 rows per rank; 300 // 128 = 2 rows each
    br, bp = B.memory_budget(rows, lr), B.memory_budget(packed, lp)
    m = packed.model
    per_token = B.activation_bytes(m, 1, 2, 2) * B._BYTES[m.dtype]
    assert bp.row("activations") == pytest.approx(per_token * 300 / B.GiB)
    assert br.row("activations") == pytest.approx(B.activation_bytes(m, 1, 2, 1) * B._BYTES[m.dtype] * 64 * 128 / B.GiB)
    assert bp.row("logits") == pytest.approx(br.row("logits") * 300 / (64 * 128))
    text = B.report(packed, lp, bp)
    assert "micro-batch(es) of 300 tokens, packed" in text and "micro-batch of 300 tokens, packed" in text
