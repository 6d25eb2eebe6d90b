"""The files a run reads, checked before any rank starts: the prompt files and the model
folder's tokenizer.

Without this check a missing data file surfaced as a traceback on every rank plus torchrun's
failure block (74 lines at 2 ranks for a one-line cause), and a model folder without
tokenizer files loaded a tokenizer of 1 token that failed later with a misleading chat
template error. The trainer's start-up (``trainer.preflight``) and the launcher's pre-check
(``python -m grpo_mega.preflight.budget --validate-only``, run by ``launch/torchrun.sh``)
call the same function, so both refuse with the same line.

    check_paths(cfg, require=True)   # ConfigError naming the flag, or TokenizerError
"""
from __future__ import annotations

from pathlib import Path

from grpo_mega.config import Config, ConfigError


def check_paths(cfg: Config, require: bool) -> None:
    """Every data path that is set is a prompt file. ``require`` (a training run about to
    start): the data paths must be set and ``model.hf_checkpoint`` must hold tokenizer files.
    Without it (``--check-config``, ``--dry-run``) a path may be left for the cluster, and a
    model folder may hold the shape alone (its config.json), as the shape fixtures do."""
    from grpo_mega.data.prompts import READERS
    from grpo_mega.data.tokenizer import check_tokenizer_dir

    d = cfg.data
    if require and not d.train_path:
        raise ConfigError("data.train_path is required: the prompts to train on (--data.train_path=FILE)")
    if require and not d.eval_path:
        # data.eval_every=0 turns off only the periodic evaluations: the run always evaluates
        # before step 1 and after the last step (summary.json's before/after accuracy).
        raise ConfigError("data.eval_path is required, also with data.eval_every=0: the run evaluates "
                          "held-out accuracy before step 1 and after the last step (--data.eval_path=FILE)")
    for path, flag in ((d.train_path, "data.train_path"), (d.eval_path, "data.eval_path")):
        if path and not Path(path).is_file():
            what = "is a directory, not a file" if Path(path).is_dir() else "does not exist"
            raise ConfigError(f"{flag}={path!r} {what} (resolved from {Path.cwd()}); give the JSONL or "
                              f"Parquet prompt file (--{flag}=FILE)")
        if path and Path(path).suffix.lower() not in READERS:
            raise ConfigError(f"{flag}={path!r}: unknown format {Path(path).suffix!r}; the prompt files "
                              f"are {', '.join(sorted(READERS))} (--{flag}=FILE)")
    if require and cfg.model.hf_checkpoint:
        check_tokenizer_dir(cfg.model.hf_checkpoint)
