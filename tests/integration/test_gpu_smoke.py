"""The offline GPU smoke (issue 39, deliverable 3), checked on a CPU so it cannot rot before a
GPU is lent: ``tools/gpu_smoke.sh``'s install step and lite tier and ``tools/wheelhouse.sh``'s
pinned list, through their dry runs (each under a second: no torch import, nothing written),
and the ``gpu`` marks that the smoke's ``pytest -m gpu`` selects by."""
from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shlex
import subprocess
import sys

from tests import REPO

LITE_LIMIT_S = 7 * 60
"""The lite tier's whole budget on one H100 (issue 39): its checks' limits must fit in it."""


def _pins(tier: str) -> list[str]:
    lines = (REPO / "tools" / "wheels" / f"{tier}.txt").read_text().splitlines()
    return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()]


def _smoke_dry_run(tmp_path, *args):
    """(the dry run's stdout, {check: (limit, argv)}); asserts it wrote nothing."""
    env = dict(os.environ, PYTHON=sys.executable, WORK=str(tmp_path / "work"),
               RESULTS_DIR=str(tmp_path / "results"), SITE=str(tmp_path / "site"))
    r = subprocess.run(["bash", "tools/gpu_smoke.sh", "--dry-run", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not any((tmp_path / d).exists() for d in ("work", "results", "site")), "a dry run wrote files"
    checks = re.findall(r"^\[gpu-smoke\] (\S+) \(limit (\d+)s\): (.*)$", r.stdout, re.M)
    return r.stdout, {name: (int(limit), shlex.split(cmd)) for name, limit, cmd in checks}


def _opt(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]


def test_gpu_smoke_installs_offline_from_the_wheelhouse_and_never_over_torch(tmp_path):
    """Guards against issue 39 finding 3, a smoke that cannot install on an offline GPU
    machine: ``--wheels DIR`` that still reads the index, or installs grpo-mega itself
    (``-e .``: pip then needs a setuptools wheel in DIR), or resolves dependencies, so a
    ``--target`` install reinstalls torch over the machine's CUDA build; a missing
    constraint pinning the installed torch; a list other than ``tools/wheels/lite.txt``
    (what ``tools/wheelhouse.sh`` downloads); grpo-mega not on PYTHONPATH after it."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    out, checks = _smoke_dry_run(tmp_path, "--wheels", str(wheels))
    argv = checks["install-lite"][1]
    assert argv[:4] == [sys.executable, "-m", "pip", "install"], argv
    opts = argv[4:]
    assert _opt(opts, "--find-links") == str(wheels) and "--no-index" in opts, opts
    assert "--no-deps" in opts and "--only-binary=:all:" in opts, opts
    assert _opt(opts, "-r") == "tools/wheels/lite.txt", opts
    constraint = _opt(opts, "-c")
    assert f"{constraint}: torch=={importlib.metadata.version('torch')}" in out, out
    forbidden = {"-e", ".", ".[gpu,test]", "--force-reinstall", "--ignore-installed", "-I", "--no-binary"}
    assert not forbidden & set(opts) and not [o for o in opts if o.startswith("torch")], opts
    target = _opt(opts, "--target")
    assert f"PYTHONPATH={target}:{REPO}" in out, out
    assert not [p for p in _pins("lite") if re.split("[=<>]", p)[0] in ("torch", "triton", "numpy")]
    # Online (no --wheels): the same pins and guards, from the index.
    _, online = _smoke_dry_run(tmp_path)
    opts = online["install-lite"][1][4:]
    assert "--no-index" not in opts and "--no-deps" in opts and "-c" in opts, opts


def test_gpu_smoke_lite_tier_runs_the_gpu_tests_and_the_1b_rows_within_7_minutes(tmp_path):
    """Guards against a lite tier that leaves a step out or cannot finish in its window
    (issue 39 deliverable 3, issue 44): the checks must be, in order, the install, the
    versions, every gpu-marked test file (the megatron optimizer's among them), the 1B
    shape at micro-batch 1; their limits must add up to at most 7 minutes; no vLLM or TE
    step may run in it. ``--tier full`` adds the install of vLLM and TE, the demo's
    conversion, its 5 GRPO steps and the log-prob gap check."""
    _, lite = _smoke_dry_run(tmp_path, "--wheels", str(tmp_path))
    assert list(lite) == ["install-lite", "versions", "gpu-tests", "bench-1b"], list(lite)
    assert sum(limit for limit, _ in lite.values()) <= LITE_LIMIT_S
    tests = lite["gpu-tests"][1]
    assert tests[1:7] == ["-m", "pytest", "-q", "-rfEs", "-m", "gpu"], tests
    files = [a for a in tests if a.startswith("tests/")]
    assert set(files) == _gpu_marked_files() and "tests/unit/optim/test_megatron_optimizer.py" in files, tests
    bench = lite["bench-1b"][1]
    assert bench[1] == "benchmarks/gpu.py" and _opt(bench, "--models") == "1b", bench
    assert _opt(bench, "--micro-batch") == "1", bench
    assert lite["versions"][1][-2:] == ["benchmarks/gpu.py", "--versions"]
    _, full = _smoke_dry_run(tmp_path, "--wheels", str(tmp_path), "--tier", "full")
    assert list(full) == list(lite) + ["install-full", "demo-convert", "demo-5-steps-local", "sync-logprob-gap"]
    assert _opt(full["install-full"][1], "-r") == "tools/wheels/full.txt"
    assert "--target" not in full["install-full"][1]  # resolved against the installed torch


def test_wheelhouse_dry_run_prints_the_pinned_list_for_python_312(tmp_path):
    """Guards against a wheelhouse for another machine or other versions: not CPython 3.12
    manylinux x86_64 wheels; dependencies resolved (without ``--no-deps`` pip fetches torch
    and its CUDA libraries, GBs); source packages (offline, they need a setuptools wheel);
    megatron-core other than 0.19.2; a printed list that is not the file's. The full tier
    downloads the lite list too, plus vllm==0.26.0 and Transformer Engine."""
    dest = tmp_path / "wh"
    r = subprocess.run(["bash", "tools/wheelhouse.sh", "--dry-run", "--dest", str(dest)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    printed = [ln.strip() for ln in r.stdout.splitlines() if ln.startswith("  ")]
    assert printed == _pins("lite") and "megatron-core==0.19.2" in printed, r.stdout
    argv = shlex.split(r.stdout.split("would run: ", 1)[1])
    assert argv[1:4] == ["-m", "pip", "download"], argv
    assert "--no-deps" in argv and "--only-binary=:all:" in argv, argv
    assert _opt(argv, "--python-version") == "3.12" and _opt(argv, "--implementation") == "cp", argv
    platforms = [argv[i + 1] for i, a in enumerate(argv) if a == "--platform"]
    assert "manylinux_2_28_x86_64" in platforms and all(p.endswith("x86_64") or p == "any" for p in platforms)
    assert _opt(argv, "-d") == str(dest) and _opt(argv, "-r") == "tools/wheels/lite.txt"
    assert not dest.exists()
    r = subprocess.run(["bash", "tools/wheelhouse.sh", "--dry-run", "--tier", "full"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    printed = [ln.strip() for ln in r.stdout.splitlines() if ln.startswith("  ")]
    assert printed == _pins("lite") + _pins("full") and "vllm==0.26.0" in printed, r.stdout
    help_text = subprocess.run(["bash", "tools/wheelhouse.sh", "--help"], cwd=REPO, capture_output=True,
                               text=True, timeout=60).stdout
    assert "LARGE" in help_text and "matching CUDA" in help_text


def _gpu_marked(node) -> bool:
    """A test function decorated with the gpu mark, or a module whose ``pytestmark`` has it."""
    if isinstance(node, ast.Assign):
        return any(getattr(t, "id", "") == "pytestmark" for t in node.targets) and \
            "pytest.mark.gpu" in ast.unparse(node.value)
    return any(ast.unparse(d).split("(")[0] == "pytest.mark.gpu" for d in getattr(node, "decorator_list", []))


def _gpu_marked_files() -> set[str]:
    return {path.relative_to(REPO).as_posix() for path in (REPO / "tests").rglob("test_*.py")
            if any(_gpu_marked(n) for n in ast.walk(ast.parse(path.read_text())))}


_USES_CUDA = re.compile(r"""backend=['"]nccl['"]|device=['"]cuda|\.cuda\(\)|skipif\(not torch\.cuda\.is_available\(\)""")


def _cuda_tests() -> dict[str, bool]:
    """{test id: gpu-marked} for every test whose body, or a same-module fixture it takes,
    uses CUDA: an NCCL launch, CUDA tensors, or a skip without CUDA."""
    out = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_marked = any(isinstance(n, ast.Assign) and _gpu_marked(n) for n in tree.body)
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        fixtures = {f.name: ast.unparse(f) for f in funcs if any("fixture" in ast.unparse(d) for d in f.decorator_list)}
        for f in funcs:
            if not f.name.startswith("test_"):
                continue
            sources = [ast.unparse(f)] + [fixtures[a.arg] for a in f.args.args if a.arg in fixtures]
            if any(_USES_CUDA.search(s) for s in sources):
                out[f"{path.relative_to(REPO).as_posix()}::{f.name}"] = module_marked or _gpu_marked(f)
    return out


def test_every_test_that_runs_on_cuda_is_gpu_marked():
    """Guards against issue 39 finding 8: ``pytest -m gpu`` selected one test, so the lite
    smoke would never have run megatron's DDP and DistributedOptimizer at one NCCL rank
    (its test was unmarked). Every test whose body or fixtures use CUDA must carry the
    ``gpu`` mark; the known ones must be found, so the scan cannot silently check nothing."""
    found = _cuda_tests()
    assert {"tests/unit/optim/test_megatron_optimizer.py::test_distributed_optimizer_megatron_steps_equal_ours",
            "tests/unit/optim/test_megatron_optimizer.py::"
            "test_distributed_optimizer_megatron_checkpoint_round_trips_bitwise",
            "tests/unit/algorithms/test_vocab_parallel_triton.py::test_fused_kernel_matches_algorithms_on_gpu",
            } <= set(found), found
    assert [t for t, marked in found.items() if not marked] == []
