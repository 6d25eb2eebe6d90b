"""grpo-mega: a Megatron-style, model-parallel GRPO trainer.

One subpackage per part of the system (docs/concepts/architecture.md; the import rules between
them are the contracts in ``.importlinter``):
  config, train   typed config (imports nothing of ours); the entry point, a list of stages
  runtime, common console, lifeline, faults, metric glossary; qualified names, safetensors
                  (leaves: they import nothing of ours)
  preflight       config validation against the registries, the memory budget
  distributed     ParallelState, the CPU compatibility layer, the pipeline schedule
  models          actor / reference GPTModel builders, precision, sharding rules, HF tables
  optim           AdamW with DP/embedding reduction, global-norm clipping, fp32 masters
  algorithms      vocab-parallel log-probs, entropy, KL, advantages, the GRPO loss
  rollout         the rollout-engine protocol and the vLLM engine
  bridge          trainer shards -> HF-named buckets -> the engine, verified
  rewards, data   reward registry and scorer; prompt datasets and tokenizers
  checkpoint      resumable trainer state, HF <-> megatron conversion
  envs, gateway   multi-turn environments; the OpenAI-compatible gateway for agent programs
  trainer         the Trainer, the step's stages, TrainingBatch, metrics
"""
__version__ = "0.1.0"

from grpo_mega.runtime import lean_imports as _lean_imports

_lean_imports.install()  # megatron's timers skip wandb (0.4 s per process); see the module
from grpo_mega.runtime import dist_cache as _dist_cache

_dist_cache.install()  # transformers' packages_distributions() from a file (0.25 s per process)
