"""What a person sees on the console: third-party noise turned down, progress bars.

Quiet by default: vLLM, torch (Python and C++), megatron and transformers log errors only
and their Python warnings are hidden, so a run prints our own ``[grpo]`` set-up lines, one
line per engine start and a line per step. ``--verbose`` (``logging.verbose``) leaves
every library as it is. ``TORCH_CPP_LOG_LEVEL`` is read once, when torch loads, so the
entry point calls ``quiet_third_party`` before importing torch; the environment
variables also reach child processes (vLLM workers, the reward pool). Variables the user
set are left alone.

Bars are tqdm on stderr, drawn only when stderr is a terminal and the caller enables them
(``logging.progress``; ``--no-progress`` in the conversion tool). In a log file or under a
test nothing is drawn and callers print their plain lines instead. Imports nothing of ours.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Iterable, Optional, Sequence

_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR", "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore",
        "TRANSFORMERS_VERBOSITY": "error", "TF_CPP_MIN_LOG_LEVEL": "3"}
_LOGGERS = ("vllm", "torch", "megatron", "transformers", "urllib3", "filelock")


def verbose_requested(argv: Sequence[str]) -> bool:
    """``--verbose`` or ``--logging.verbose=true`` on the command line (read before the config
    is parsed, since quieting must happen before torch loads)."""
    return any(a == "--verbose" or a.lower() in ("--logging.verbose=true", "--logging.verbose=1")
               for a in argv)


def quiet_third_party(verbose: bool) -> None:
    """Turn the libraries' logging down to errors and hide their warnings (not ours); a
    no-op when ``verbose``. Idempotent."""
    if verbose:
        return
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=r"grpo_mega(\.|$)")  # ours stay visible
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def bar(iterable: Optional[Iterable] = None, *, desc: str, total: Optional[int] = None,
        unit: str = "it", initial: int = 0, enabled: bool = True):
    """A tqdm bar (disabled off a terminal or when ``enabled`` is False; iterating a
    disabled bar yields the items as they are)."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, initial=initial, file=sys.stderr,
                disable=None if enabled else True, dynamic_ncols=True, leave=True)


def shown(b) -> bool:
    """Whether ``b`` draws anything (False for None or a disabled bar)."""
    return b is not None and not b.disable


def write(msg: str) -> None:
    """Print a line to stdout without tearing a bar that is being drawn on stderr."""
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stdout)
    sys.stdout.flush()
