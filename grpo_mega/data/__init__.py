"""Data: prompt datasets (JSONL/Parquet, resumable order, per-replica shards) and
tokenizers (HF tokenizer directories and raw sentencepiece models)."""
from grpo_mega.data.prompts import (DataError, Prompt, PromptDataset, read_rows, render_messages,
                                    render_prompt, shard_for_replica)

__all__ = ["DataError", "Prompt", "PromptDataset", "read_rows", "render_messages", "render_prompt",
           "shard_for_replica"]
