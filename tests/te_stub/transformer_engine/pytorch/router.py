"""TE's fused MoE router kernels, which megatron-core 0.19 imports from TE 2.7 on (never called:
the project's configs leave ``moe_router_fusion`` off)."""


def _not_here(*args, **kwargs):
    raise NotImplementedError("transformer_engine stub: no fused router kernels")


fused_compute_score_for_moe_aux_loss = fused_moe_aux_loss = fused_topk_with_score_function = _not_here
