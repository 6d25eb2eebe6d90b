"""Check a shell command shown in the docs or a recipe as the programs it names would.

``check_command(line)`` parses one command line (backslash continuations joined) and:

* ``launch/torchrun.sh``, ``sbatch ... launch/slurm/grpo.sbatch``, ``torchrun ... -m
  grpo_mega.train`` and ``python -m grpo_mega.train``: loads the config and overrides as the
  trainer does, takes the model shape from ``model.hf_checkpoint``'s config.json (an existing
  directory, or the fixture of the same name in ``tests/fixtures/hf_shapes``), and runs the
  trainer's start-up validation at the command's world size (hardware probes off). A real
  launch (no ``--dry-run``/``--check-config``/``--shrink``) must also name the paths start-up
  requires: ``model.hf_checkpoint``, ``data.train_path`` and ``data.eval_path``;
* ``python -m grpo_mega.preflight.budget``: runs it and requires exit status 0;
* ``python tools/<tool>.py`` and ``torchrun ... tools/<tool>.py``: parses the arguments with
  the tool's own argparse parser;
* ``make <target>``: the target exists in the Makefile, and ``ARGS=`` overrides load;
* any other program: the repository files it names exist.

Returns a short description of what was checked; raises AssertionError or ConfigError.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHAPES = REPO / "tests" / "fixtures" / "hf_shapes"
LAUNCH_OPTIONS = ("--dry-run", "--check-config", "--shrink")


def _split_env(tokens: list[str]) -> tuple[dict, list[str]]:
    env = {}
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        k, v = tokens.pop(0).split("=", 1)
        env[k] = v
    return env, tokens


def _shape_dir(hf: str) -> Path | None:
    if (REPO / hf / "config.json").is_file():
        return REPO / hf
    if Path(hf).is_absolute() and (Path(hf) / "config.json").is_file():
        return Path(hf)
    fixture = SHAPES / Path(hf).name
    return fixture if (fixture / "config.json").is_file() else None


def check_train(config: str | None, overrides: list[str], world: int | None, real_launch: bool) -> str:
    """Validate a trainer config + overrides as start-up does; returns the world checked."""
    from grpo_mega.config import load_config
    from grpo_mega.preflight.shape import model_shape_from_hf
    from grpo_mega.preflight.validate import validate

    cfg = load_config(str(REPO / config) if config else None, overrides)
    if real_launch:
        for flag, value in (("model.hf_checkpoint", cfg.model.hf_checkpoint),
                            ("data.train_path", cfg.data.train_path), ("data.eval_path", cfg.data.eval_path)):
            assert value, f"this launch stops at start-up: it does not set --{flag}"
    shape = "the config's shape"
    if cfg.model.hf_checkpoint:
        found = _shape_dir(cfg.model.hf_checkpoint)
        if found is None and real_launch:
            raise AssertionError(f"no config.json for {cfg.model.hf_checkpoint}: add its shape to {SHAPES}")
        if found is not None:
            cfg.model.hf_checkpoint = str(found)
            shape = model_shape_from_hf(cfg)
    p = cfg.parallel
    world = world or p.tp * p.pp * max(p.dp, 1)
    validate(cfg, world, check_hardware=False)
    return f"validated at world {world} with {shape}"


def _tool_parser(path: Path):
    spec = importlib.util.spec_from_file_location(f"_docs_tool_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses in the tool look their module up there
    spec.loader.exec_module(mod)
    return mod


def _check_tool(script: str, args: list[str]) -> str:
    path = REPO / script
    assert path.is_file(), f"{script} does not exist"
    mod = _tool_parser(path)
    if hasattr(mod, "build_parser"):
        mod.build_parser().parse_args(args)
    elif path.name == "shrink_config.py":
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                mod.main(["--help"])
            except SystemExit:
                pass
    return f"{script} arguments parse"


def check_command(line: str) -> str:
    line = line.replace("\\\n", " ")
    line = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
    tokens = shlex.split(line)
    if not tokens:
        return "empty"
    env, tokens = _split_env(tokens)
    prog, args = tokens[0], tokens[1:]
    opts = [a for a in args if a in LAUNCH_OPTIONS]
    if prog.endswith("launch/torchrun.sh"):
        args = [a for a in args if a not in LAUNCH_OPTIONS]
        world = None
        if "NNODES" in env or "NPROC_PER_NODE" in env:
            world = int(env.get("NNODES", 1)) * int(env.get("NPROC_PER_NODE", 1))
        config = env.get("CONFIG")
        if config:
            assert (REPO / config).is_file(), f"CONFIG={config} does not exist"
        if "--shrink" in opts:
            world = None  # the shrunk world, not the config's
        return check_train(config, args, world, real_launch=not opts)
    if prog == "sbatch":
        nodes, config, i = 4, "launch/configs/qwen2.5_32b.yaml", 0
        while i < len(args) and args[i].startswith("--"):
            a = args[i]
            if a.startswith("--nodes="):
                nodes = int(a.split("=", 1)[1])
            if a.startswith("--export="):
                for kv in a.split("=", 1)[1].split(","):
                    if kv.startswith("CONFIG="):
                        config = kv.split("=", 1)[1]
            i += 1
        assert args[i] == "launch/slurm/grpo.sbatch", args[i]
        return check_train(config, args[i + 1:], nodes * int(env.get("NPROC_PER_NODE", 8)), real_launch=True)
    if prog == "launch/slurm/grpo.sbatch":
        assert args == ["--dry-run"], args
        return "dry run"
    if prog in ("python", "python3", ".venv/bin/python", "torchrun") or prog.endswith("/python"):
        nproc = None
        if prog == "torchrun":
            for j, a in enumerate(args):
                if a == "--nproc-per-node":
                    nproc = int(args[j + 1])
            while args and args[0].startswith("--"):
                args = args[2:] if args[0] == "--nproc-per-node" else args[1:]
        if args[:2] == ["-m", "grpo_mega.train"]:
            rest = args[2:]
            config = None
            if "--config" in rest:
                k = rest.index("--config")
                config, rest = rest[k + 1], rest[:k] + rest[k + 2:]
            rest = [a for a in rest if a != "--verbose"]
            if rest == ["--help"]:
                return "help"
            return check_train(config, rest, nproc, real_launch=True)
        if args[:2] == ["-m", "grpo_mega.preflight.budget"]:
            from grpo_mega.preflight.budget import main
            rest = [a for a in args[2:] if a != "--write-budget"]  # never rewrite a file from a test
            with contextlib.redirect_stdout(io.StringIO()):
                rc = main(rest)
            assert rc == 0, f"budget exited {rc}"
            return "budget ran"
        if args[:2] == ["-m", "pytest"]:
            for a in args[2:]:
                if a.startswith("tests"):
                    assert (REPO / a.split("::")[0]).exists(), f"{a} does not exist"
            return "test paths exist"
        if args and args[0].endswith(".py"):
            script = args[0]
            if script.startswith(("tools/", "benchmarks/")):
                return _check_tool(script, args[1:]) if script.startswith("tools/") else \
                    (f"{script} exists" if (REPO / script).is_file() else _fail(f"{script} does not exist"))
            assert (REPO / script).is_file(), f"{script} does not exist"
            return f"{script} exists"
        if args[:1] == ["-m"]:
            assert importlib.util.find_spec(args[1]) is not None, f"no module {args[1]}"
            return f"module {args[1]} exists"
        raise AssertionError(f"unrecognised python command: {line}")
    if prog == "make":
        targets = re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), flags=re.M)
        plain = [a for a in args if "=" not in a]
        for t in plain:
            assert t in targets, f"make {t}: no such target (Makefile has {targets})"
        for a in args:
            if a.startswith("ARGS=") and plain == ["mutations"]:
                _check_tool("tools/mutations.py", shlex.split(a[5:]))
            elif a.startswith("ARGS="):
                demo_args = shlex.split(a[5:])
                if "--lora" in demo_args:  # the demo adds its LoRA flags before the user's
                    from grpo_mega.demo.__main__ import LORA_OVERRIDES
                    demo_args = LORA_OVERRIDES + demo_args
                demo_args = [x for x in demo_args if x not in ("--fresh", "--moe", "--tools", "--lora", "--verbose")]
                from grpo_mega.config import load_config
                load_config(str(REPO / "grpo_mega/configs/demo.yaml"), demo_args)
        return f"make {' '.join(plain)}"
    if re.match(r"^(launch|tools|benchmarks)/", prog):  # a repository script run directly
        assert (REPO / prog).is_file(), f"{prog} does not exist"
    for a in args:  # kubectl, pip, sbatch wrappers...: the repository files named exist
        if re.match(r"^(launch|tools|grpo_mega|examples|benchmarks|tests)/", a):
            assert (REPO / a).exists(), f"{a} does not exist"
    return f"{prog}: files exist"


def _fail(msg: str):
    raise AssertionError(msg)
