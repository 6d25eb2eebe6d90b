"""The memory budget's LoRA rows (``model.lora``; ``budget.py`` calls ``apply_lora`` last).

Under LoRA the base is frozen: megatron builds gradient buffers and the optimizers build their
state over ``requires_grad`` parameters only, so the base has no fp32 main grads, no Adam m, v
and no fp32 master copy. Only the adapters have them. The KL reference is the actor with its
adapters off (``grpo_mega.lora.ReferenceView``), so there is no reference copy either. The
adapters themselves sit beside the base, in ``model.dtype`` (``grpo_mega.lora._param``).

Adapter parameters on one GPU, per layer (``h`` hidden, ``q = (heads + 2 kv) * head_dim``,
``a = heads * head_dim``, ``f`` ffn, ``r`` rank; ``grpo_mega.lora`` says which factor is
sharded):

    linear_qkv   (column)  A [r, h] replicated      + B [q / tp, r]
    linear_proj  (row)     A [r, a / tp]            + B [h, r] replicated
    linear_fc1   (column)  A [r, h] replicated      + B [2 f / tp, r]
    linear_fc2   (row)     A [r, f / tp]            + B [h, r] replicated

times ``num_layers / pp`` layers (no adapters on embeddings, norms or the output layer).
Their activations (``x A^T``, r elements per token per adapted linear) are below 1% of a
layer's and not counted. Pure arithmetic; ``tests/unit/preflight/test_budget_lora.py`` ties
the count to ``grpo_mega.lora.lora_parameter_count`` of a built model (TP 1).
"""
from __future__ import annotations

from grpo_mega.config import Config, LoraConfig, ModelConfig
from grpo_mega.preflight.params import head_dim
from grpo_mega.preflight.phases import Row

GiB = float(1 << 30)
_BYTES = {"float32": 4, "bfloat16": 2}


def adapter_shapes(m: ModelConfig, lora: LoraConfig, tp: int) -> dict[str, tuple[int, int]]:
    """Target linear -> (A elements, B elements) of one layer on one TP rank."""
    h, hd, r = m.hidden_size, head_dim(m), lora.rank
    q, a, f = (m.num_attention_heads + 2 * m.num_query_groups) * hd, m.num_attention_heads * hd, m.ffn_hidden_size
    every = {"linear_qkv": (r * h, q // tp * r), "linear_proj": (r * (a // tp), h * r),
             "linear_fc1": (r * h, 2 * f // tp * r), "linear_fc2": (r * (f // tp), h * r)}
    return {t: every[t] for t in lora.target_modules}


def adapter_params(m: ModelConfig, lora: LoraConfig, tp: int, pp: int) -> int:
    """Adapter parameters on one GPU of any pipeline stage (each stage has ``layers / pp``)."""
    per_layer = sum(a + b for a, b in adapter_shapes(m, lora, tp).values())
    return per_layer * (m.num_layers // pp)


def apply_lora(rows: list[Row], cfg: Config, tp: int, pp: int, dp: int) -> None:
    """Rewrite ``budget.py``'s trainer rows in place for ``cfg.model.lora``: the weights gain
    the adapters; gradients, optimizer state and the step's reduced slice count the adapters
    only; the reference row is 0. A no-op without LoRA."""
    m, o, lora = cfg.model, cfg.optimizer, cfg.model.lora
    if lora is None:
        return
    n_a = adapter_params(m, lora, tp, pp)
    wb = _BYTES[m.dtype]
    dist = o.use_distributed_optimizer and dp > 1
    opt_bytes = 8 + (4 if wb < 4 or o.use_distributed_optimizer else 0)
    opt_params = n_a / (dp if dist else 1)
    by = {r.name: r for r in rows}
    w = by["policy weights"]
    w.gib += n_a * wb / GiB
    w.note += (f" + {n_a / 1e6:.2f}M LoRA adapter params (rank {lora.rank}, "
               f"{len(lora.target_modules)} linears/layer), base frozen")
    by["gradients"].gib = n_a * 4 / GiB
    by["gradients"].note = "fp32 main grads of the LoRA adapters only (the base is frozen)"
    by["optimizer"].gib = opt_params * opt_bytes / GiB
    by["optimizer"].note = (f"Adam state of the LoRA adapters only ({opt_bytes} B/param)"
                            + (f", distributed over dp={dp}" if dist else ", not sharded"))
    ref = by["reference weights"]
    ref.gib = 0.0
    ref.note = ("kl_coef=0: no reference" if cfg.algorithm.kl_coef <= 0 else
                "none: the reference is the actor with its LoRA adapters off")
    step = by["step gradients"]
    if step.gib:
        step.gib = opt_params * 4 / GiB
