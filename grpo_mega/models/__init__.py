"""Models: megatron-core ``GPTModel`` builders for the actor and the frozen reference
(Transformer Engine spec on GPU, local spec elsewhere), precision and FP8 settings
(``precision``), the TP/PP sharding rules of megatron parameter names (``layout``),
and one pure megatron <-> HF mapping table per model family (``hf``)."""
from grpo_mega.models.gpt import (build_model, forward_logits, head_dim, layer_spec, mask_vocab_padding,
                                  offload, padded_vocab_size, sharded_state_dict, transformer_config,
                                  unwrap_model)
from grpo_mega.models.precision import te_available

__all__ = ["build_model", "forward_logits", "head_dim", "layer_spec", "mask_vocab_padding", "offload",
           "padded_vocab_size", "sharded_state_dict", "transformer_config", "te_available", "unwrap_model"]
