"""grpo-mega: a Megatron-style, model-parallel GRPO trainer.

Modules, one concern each:
  config      typed config dataclasses, YAML + ``--section.key=value`` overrides
  parallel    torch.distributed + megatron model-parallel groups as one object
  cpu_compat  makes megatron-core run on a CPU-only torch (applied only then)
  models      actor / reference GPTModel builders (TE spec when available)
  optimizer   optimizer with global-norm clipping across TP/PP/DP
  algorithms  vocab-parallel log-probs, entropy, KL, advantages, GRPO loss
  tokenizer, data, rewards, rollout   prompts -> vLLM samples -> scores
  mapping, bridge                     Megatron <-> HF names; weight sync
  checkpoint, metrics, train          the GRPO loop
"""
__version__ = "0.1.0"
