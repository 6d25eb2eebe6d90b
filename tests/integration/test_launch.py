"""Launchers, proven on real launchers: launch/torchrun.sh (one node, two nodes, a dying
node), launch/slurm/grpo.sbatch on a real single-node Slurm (daemons started here),
the Kubeflow PyTorchJob manifest, and grpo_mega.preflight.budget on the scale configs.

Cost on 2 shared cores: about 2.5 minutes (two two-node torchrun launches, a Slurm job
running the demo trainer, and a requeued Slurm job), plus a one-time ``apt-get install slurmctld slurmd slurm-client munge`` when
Slurm is missing (root with network only; otherwise the Slurm test skips, saying why).

    OMP_NUM_THREADS=1 python -m pytest -q tests/integration/test_launch.py
    python -m pytest -q tests/integration/test_launch.py -m "not slow"     # the fast checks only
"""
from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

from grpo_mega.preflight import budget as cc
from grpo_mega.config import load_config
from grpo_mega.preflight.validate import validate
from grpo_mega.distributed.state import free_port
from tests import REPO

REPO = REPO
TORCHRUN_SH = REPO / "launch" / "torchrun.sh"
SBATCH = REPO / "launch" / "slurm" / "grpo.sbatch"
MANIFEST = REPO / "launch" / "k8s" / "pytorchjob.yaml"
CONFIGS = {  # name: (file, world size, nodes of 8 GPUs)
    "llama3_8b": ("launch/configs/llama3_8b.yaml", 8, 1),
    "qwen2.5_32b": ("launch/configs/qwen2.5_32b.yaml", 32, 4),
    "llama3_70b": ("launch/configs/llama3_70b.yaml", 64, 8),
    "qwen3_30b_a3b": ("launch/configs/qwen3_30b_a3b.yaml", 16, 2),
}
COLLECTIVE = "tests/scripts/launch_collective.py"

# The job every real launch below runs at world size 2 (TP=2 over gloo): ENTRY module,
# CONFIG file ("" = none), config overrides, and a line its rank 0 prints on success:
# a few steps of the demo config (vLLM rollouts, KL, a checkpoint). The requeue test
# runs the stand-in tests/scripts/launch_resume.py instead (it is about the launcher).
DEMO = REPO / "grpo_mega" / "assets" / "demo_v1"
JOB = ("grpo_mega.train", "grpo_mega/configs/demo.yaml",
       [f"--model.hf_checkpoint={DEMO / 'hf'}", f"--data.train_path={DEMO / 'train.jsonl'}",
        f"--data.eval_path={DEMO / 'eval.jsonl'}", "--algorithm.steps=2", "--data.eval_every=0",
        "--data.prompts_per_step=4", "--parallel.micro_batch_size=16",
        "--algorithm.time_limit_minutes=0", "--logging.tensorboard=false", "--logging.plot=false",
        f"--logging.run_dir={tempfile.mkdtemp(prefix='grpo_launch_')}"],
       "[grpo] done:")


def launch_env(**overrides: str) -> dict:
    """Environment for a launch: this interpreter, one thread per rank, no inherited layout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT",
                        "CONFIG", "ENTRY", "RDZV_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK")
           and not k.startswith(("SLURM_", "PET_"))}
    env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    env.update(overrides)
    return env


def run_script(args, env, timeout=300):
    # A hang guard, not a speed bound: a dry run takes ~7 s alone and once took over 60 s
    # while the suite's 4-rank engines held both cores (2026-11-28 run).
    return subprocess.run([str(a) for a in args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def start_agent(node_rank: int, port: int, log: Path, entry: str, config: str, args, **env):
    """One torchrun agent (a "node") in its own process group, output to ``log``."""
    e = launch_env(NNODES="2", NODE_RANK=str(node_rank), NPROC_PER_NODE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ENTRY=entry, CONFIG=config,
                   RDZV_ID=f"test-{port}", **env)
    return subprocess.Popen([str(TORCHRUN_SH), *args], cwd=REPO, env=e, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


# --------------------------------------------------------------- torchrun.sh, fast

def test_dry_run_prints_exact_multinode_command():
    """Guards the command itself: c10d rendezvous on MASTER_ADDR:MASTER_PORT, node 0 hosts
    the store (a worker node must not), entry and overrides passed through untouched."""
    env = launch_env(NNODES="2", NODE_RANK="1", NPROC_PER_NODE="4", MASTER_ADDR="10.0.0.7",
                     MASTER_PORT="29555", ENTRY="grpo_mega.train", RDZV_ID="job42")
    r = run_script([TORCHRUN_SH, "--dry-run", "--parallel.tp=2", "--rollout.stop=[\"a b\"]"], env)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    argv = shlex.split(line)
    assert argv[:2] == ["OMP_NUM_THREADS=1", "CUDA_DEVICE_MAX_CONNECTIONS=1"]
    cmd = argv[2:]
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    joined = " ".join(cmd)
    for part in ("--nnodes 2", "--nproc-per-node 4", "--node-rank 1", "--rdzv-backend c10d",
                 "--rdzv-endpoint 10.0.0.7:29555", "--rdzv-id job42", "--max-restarts 0"):
        assert part in joined, (part, line)
    conf = cmd[cmd.index("--rdzv-conf") + 1]
    assert "is_host=0" in conf and "join_timeout=" in conf
    assert cmd[-4:] == ["-m", "grpo_mega.train", "--parallel.tp=2", '--rollout.stop=["a b"]']

    # Node 0 hosts the store; one node uses a free port; a .py ENTRY runs as a script.
    env.update(NODE_RANK="0", ENTRY=COLLECTIVE, CONFIG="launch/configs/llama3_8b.yaml", NPROC_PER_NODE="4",
               SKIP_CONFIG_CHECK="1")
    cmd = shlex.split(run_script([TORCHRUN_SH, "--dry-run"], env).stdout.splitlines()[-1])[2:]
    assert "is_host=1" in cmd[cmd.index("--rdzv-conf") + 1]
    assert cmd[-3:] == [COLLECTIVE, "--config", "launch/configs/llama3_8b.yaml"]
    single = launch_env(NPROC_PER_NODE="2", ENTRY="grpo_mega.train")
    cmd = shlex.split(run_script([TORCHRUN_SH, "--dry-run", "--parallel.tp=2"], single).stdout.splitlines()[-1])
    assert "127.0.0.1:0" in cmd and "is_host" not in " ".join(cmd)


def test_multinode_without_master_addr_fails_fast_naming_it():
    """Without MASTER_ADDR every node would rendezvous on its own localhost and wait
    RDZV_TIMEOUT (15 min) before failing; the script must refuse at once."""
    t0 = time.time()
    r = run_script([TORCHRUN_SH, "--parallel.tp=2"],
                   launch_env(NNODES="2", NODE_RANK="0", NPROC_PER_NODE="1", ENTRY="grpo_mega.train"))
    assert r.returncode == 2
    assert "MASTER_ADDR is not set" in r.stderr and "NNODES=2" in r.stderr
    assert "[torchrun.sh] node" not in r.stderr  # torchrun never started
    assert time.time() - t0 < 10


def test_world_size_not_matching_layout_fails_fast_naming_variables():
    """A world the layout cannot fill would hang in the first collective on some rank; the
    script checks NNODES x NPROC_PER_NODE against tp x pp x dp before torchrun starts."""
    r = run_script([TORCHRUN_SH], launch_env(NPROC_PER_NODE="4", CONFIG=CONFIGS["llama3_8b"][0]))
    assert r.returncode == 2
    assert "NNODES x NPROC_PER_NODE = 1 x 4 = world size 4" in r.stderr
    assert "parallel.dp=2" in r.stderr and "--parallel.dp" in r.stderr
    r = run_script([TORCHRUN_SH, "--parallel.tp=2"], launch_env(NPROC_PER_NODE="1", ENTRY="grpo_mega.train"))
    assert r.returncode == 2 and "world size 1" in r.stderr and "parallel.tp" in r.stderr
    r = run_script([TORCHRUN_SH], launch_env(NNODES="2", NODE_RANK="2", MASTER_ADDR="h"))
    assert r.returncode == 2 and "NODE_RANK=2" in r.stderr
    r = run_script([TORCHRUN_SH], launch_env(CONFIG="launch/configs/missing.yaml"))
    assert r.returncode == 2 and "CONFIG=launch/configs/missing.yaml does not exist" in r.stderr
    assert "[torchrun.sh] node" not in r.stderr


# ------------------------------------------------------------------- check_config

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_scale_config_validates_and_fits_80gb(name):
    """The scale configs must load, pass the trainer's own validation at their world size,
    and fit an 80 GiB GPU with the engine's KV cache able to hold at least one sequence."""
    path, world, nodes = CONFIGS[name]
    cfg = load_config(str(REPO / path))
    validate(cfg, world, check_hardware=False)
    layout = cc.derive_layout(cfg, world)
    assert layout.nodes == nodes and layout.tp * layout.pp * layout.dp == world
    assert layout.gpus_per_node % layout.tp == 0, "TP must stay inside a node"
    b = cc.memory_budget(cfg, layout)
    assert b.fits, cc.report(cfg, layout, b)
    assert 5 < b.peak_gib < 80 and b.kv_seqs >= 1


def test_param_counts_match_published_models():
    """The budget starts from the parameter count; these are the exact HF totals."""
    expected = {"llama3_8b": 8_030_261_248, "qwen2.5_32b": 32_763_876_352, "llama3_70b": 70_553_706_496}
    for name, total in expected.items():
        m = load_config(str(REPO / CONFIGS[name][0])).model
        assert cc.count_params(m, 1, 1).total == total, name
        # Per-GPU shards add back up to the padded model (norms replicated, vocab padded).
        pc = cc.count_params(m, 8, 1)
        assert 0.95 * total / 8 < pc.worst_stage < 1.05 * total / 8


def test_budget_numbers_are_sane():
    """8B bf16 weights at TP=8 are ~2 GB per GPU; grads fp32 are twice the bf16 weights;
    Adam+master is 12 B/param and halves with the distributed optimizer over dp=2; PP
    divides the weights; the engine's KV cache is what its share leaves after weights."""
    cfg = load_config(str(REPO / CONFIGS["llama3_8b"][0]), ["--parallel.tp=8", "--parallel.dp=1"])
    lay = cc.derive_layout(cfg, 8)
    b = cc.memory_budget(cfg, lay)
    assert 1.9e9 < b.row("policy weights") * cc.GiB < 2.1e9
    assert b.row("gradients") == pytest.approx(2 * b.row("policy weights"))
    assert b.row("optimizer") == pytest.approx(6 * b.row("policy weights"))  # dp=1: not sharded
    assert b.row("KV cache") == pytest.approx(
        b.row("engine share") - b.row("engine weights") - cc.ENGINE_OVERHEAD_GIB)
    base = cc.memory_budget(cfg := load_config(str(REPO / CONFIGS["llama3_8b"][0])), cc.derive_layout(cfg, 8))
    assert base.row("optimizer") == pytest.approx(3 * base.row("policy weights"))  # 12 B / 2 / dp 2
    cfg70 = load_config(str(REPO / CONFIGS["llama3_70b"][0]))
    b70 = cc.memory_budget(cfg70, cc.derive_layout(cfg70, 64))
    assert 4.0 < b70.row("policy weights") < 4.5  # 70.6B / 32 model-parallel GPUs x 2 B
    # Activations scale with the micro-batch (the config's is a token budget: packed
    # micro-batches); no reference model without KL.
    tokens = cfg70.parallel.max_tokens_per_micro_batch
    assert tokens > 0, "the 70B recipe is expected to pack under a token budget"
    cfg70b = load_config(str(REPO / CONFIGS["llama3_70b"][0]), [f"--parallel.max_tokens_per_micro_batch={2 * tokens}",
                                                               "--algorithm.kl_coef=0"])
    b70b = cc.memory_budget(cfg70b, cc.derive_layout(cfg70b, 64))
    assert b70b.row("activations") == pytest.approx(2 * b70.row("activations"))
    assert b70b.row("reference weights") == 0.0
    # Megatron's padding rule, shared with the model builder.
    from grpo_mega.models import padded_vocab_size
    for v, tp in ((128256, 8), (152064, 8), (300, 2), (32000, 1)):
        assert cc.padded_vocab(v, tp, 128) == padded_vocab_size(v, tp, 128)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_budget_comment_in_config_is_current(name):
    """The memory budget written into each config must be what check_config computes now
    (regenerate with --write-budget after changing the config or the estimate)."""
    path = CONFIGS[name][0]
    cfg = load_config(str(REPO / path))
    layout = cc.derive_layout(cfg, CONFIGS[name][1])
    block = cc.budget_block(cfg, layout, cc.memory_budget(cfg, layout), path)
    assert block in (REPO / path).read_text(), f"run: python -m grpo_mega.preflight.budget --config {path} --write-budget"


def test_check_config_cli_and_torchrun_check_config():
    """--check-config must print layout and budget without starting anything, from the
    config's own layout or from NNODES/NPROC_PER_NODE; a mismatch exits 2 naming the fix."""
    path = CONFIGS["llama3_70b"][0]
    r = run_script([TORCHRUN_SH, "--check-config"], launch_env(CONFIG=path))
    assert r.returncode == 0, r.stderr
    assert "world 64 = tp 8 x pp 4 x dp 2 on 8 node(s)" in r.stdout
    for row in ("policy weights", "gradients", "optimizer", "activations", "KV cache", "peak"):
        assert row in r.stdout
    r = run_script([TORCHRUN_SH, "--check-config", "--parallel.dp=0"],
                   launch_env(CONFIG=path, NNODES="16", NPROC_PER_NODE="8"))
    assert r.returncode == 0 and "world 128 = tp 8 x pp 4 x dp 4 on 16 node(s)" in r.stdout, r.stderr
    r = run_script([sys.executable, "-m", "grpo_mega.preflight.budget", "--config", path, "--world-size", "48"],
                   launch_env())
    assert r.returncode == 2 and "world size 48" in r.stderr and "--parallel" in r.stderr


def _start_up_verdict(path: str, world: int, overrides: list[str], check_hardware: bool = True) -> str:
    """What the trainer's start-up validation says on this machine: "ok" or the error. The
    GPU probes are run too (unless ``check_hardware=False``), so only configs they accept on
    a CPU are compared."""
    try:
        validate(load_config(str(REPO / path), overrides), world, check_hardware=check_hardware)
        return "ok"
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("overrides", [[], ["--rollout.tp=3"], ["--rollout.engine_mode=inprocess"],
                                       ["--data.prompts_per_step=66", "--data.mini_batch_size=132"]],
                         ids=["as-written", "rollout-tp-3", "inprocess", "prompts-66"])
def test_scale_config_check_config_refuses_what_start_up_refuses(overrides):
    """Guards against launch/torchrun.sh --check-config passing a config the trainer refuses
    at start-up (it used to validate with every start-up-only check off, so the scale
    configs queued and then failed): on the 32B config (world 32, engine TP 8) the launcher
    and the trainer's own validation must agree, error for error. A rollout.tp that does not
    divide the world, an in-process engine in a world of 32, or 66 prompts over 4 engine
    replicas of 8 ranks must fail before queueing."""
    path = CONFIGS["qwen2.5_32b"][0]
    want = _start_up_verdict(path, 32, overrides)
    r = run_script([TORCHRUN_SH, "--check-config", *overrides], launch_env(CONFIG=path))
    if want == "ok":
        assert r.returncode == 0 and "fits" in r.stdout, r.stderr
    else:
        assert r.returncode == 2 and want in r.stderr, (want, r.stderr)
    if overrides:
        assert want != "ok"  # each of these is refused
    else:
        assert want == "ok", want  # the config as written starts (distributed optimizer included)


@pytest.mark.parametrize("nodes, overrides, needle", [
    (2, [], None),
    (3, ["--parallel.dp=0", "--parallel.ep=12"], "model.num_experts=128 is not divisible by parallel.ep=12"),
    (2, ["--parallel.ep=16"], "parallel.ep=16 must divide the data-parallel size 8"),
    (2, ["--optimizer.use_distributed_optimizer=true"], "does not reduce expert grads over the expert-DP group"),
], ids=["as-written", "ep-12-of-128-experts", "ep-16-over-dp-8", "grpo-distributed-optimizer"])
def test_moe_check_config_refuses_an_ep_that_does_not_divide_the_experts(nodes, overrides, needle):
    """Guards against ``--check-config`` passing an MoE layout the trainer cannot build:
    Qwen3-30B-A3B on 3 nodes at EP 12 (12 divides the DP size 24/2 = 12 but not the 128
    experts), EP 16 over 8 DP ranks, or the grpo distributed optimizer at EP > 1 (it would
    reduce expert grads over the whole DP group). Each must exit 2 naming the field, and
    agree with the trainer's start-up validation; the config as written passes."""
    path = CONFIGS["qwen3_30b_a3b"][0]
    # The config is for GPUs: on this CPU, start-up also refuses its two MoE engine replicas
    # (vLLM's CPU build has no data-parallel MoE dispatch), a check of this machine that
    # --check-config, validating for the target cluster, rightly leaves out.
    if needle is None and not torch.cuda.is_available():
        assert "--rollout.tp=16" in _start_up_verdict(path, 8 * nodes, overrides)
    want = _start_up_verdict(path, 8 * nodes, overrides, check_hardware=False)
    r = run_script([TORCHRUN_SH, "--check-config", *overrides],
                   launch_env(CONFIG=path, NNODES=str(nodes), NPROC_PER_NODE="8"))
    if needle is None:
        assert want == "ok" and r.returncode == 0 and "fits" in r.stdout, (want, r.stderr)
        assert "ep 8 inside dp" in r.stdout and "16 experts" in r.stdout
    else:
        assert needle in want and r.returncode == 2 and want in r.stderr, (want, r.stderr)


# --------------------------------------------------------------------- k8s manifest

def test_pytorchjob_manifest_structure():
    """The manifest must be a PyTorchJob the training-operator accepts (container named
    pytorch, port pytorchjob-port), whose master and workers run the same entry through
    torchrun.sh with sizes that agree, checkpoints on a shared ReadWriteMany volume."""
    job = yaml.safe_load(MANIFEST.read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] >= 1
    containers = {}
    for role, spec in specs.items():
        assert spec["restartPolicy"] in ("OnFailure", "ExitCode")
        pod = spec["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch"
        assert any(p["name"] == "pytorchjob-port" for p in c["ports"])
        env = {e["name"]: e.get("value") for e in c["env"]}
        containers[role] = (c["command"], env, c["resources"], c["volumeMounts"], pod["volumes"])
        assert int(env["NNODES"]) == specs["Master"]["replicas"] + specs["Worker"]["replicas"]
        assert env["NPROC_PER_NODE"] == job["spec"]["nprocPerNode"]
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == int(env["NPROC_PER_NODE"])
        assert "launch/torchrun.sh" in " ".join(c["command"]) and env["ENTRY"] == "grpo_mega.train"
        vols = {v["name"]: v for v in pod["volumes"]}
        shared = [m for m in c["volumeMounts"] if "persistentVolumeClaim" in vols[m["name"]]]
        assert shared and any(f"{shared[0]['mountPath']}/" in a and "checkpoint.dir" in a for a in c["command"])
        # The config it names exists, and its layout fills exactly this job.
        cfg = load_config(str(REPO / env["CONFIG"]))
        validate(cfg, int(env["NNODES"]) * int(env["NPROC_PER_NODE"]), check_hardware=False)
    assert containers["Master"] == containers["Worker"]
    assert "elasticPolicy" not in job["spec"]  # fixed TP x PP x DP layout: not elastic
    assert job["spec"]["runPolicy"]["backoffLimit"] >= 1


def test_pytorchjob_command_yields_expected_torchrun_line():
    """Run the manifest's own container command (with --dry-run) under the variables the
    operator injects: the master hosts the rendezvous, a worker gets its node rank."""
    job = yaml.safe_load(MANIFEST.read_text())
    lines = {}
    for role, rank in (("Master", 0), ("Worker", 2)):
        c = job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"][0]
        env = launch_env(**{e["name"]: e["value"] for e in c["env"]},
                         MASTER_ADDR="grpo-mega-qwen32b-master-0", MASTER_PORT="23456", RANK=str(rank),
                         SKIP_CONFIG_CHECK="1")
        script = c["command"][-1].replace("exec launch/torchrun.sh", "exec launch/torchrun.sh --dry-run")
        r = run_script([*c["command"][:-1], script], env)
        assert r.returncode == 0, r.stderr
        lines[role] = r.stdout.strip().splitlines()[-1]
    assert "--node-rank 0" in lines["Master"] and "is_host=1" in lines["Master"]
    assert "--node-rank 2" in lines["Worker"] and "is_host=0" in lines["Worker"]
    for line in lines.values():
        assert "--rdzv-endpoint grpo-mega-qwen32b-master-0:23456" in line
        assert "--nnodes 4 --nproc-per-node 8" in line and "-m grpo_mega.train" in line


def test_sbatch_dry_run_outside_slurm():
    """The template must say what it would run: head node, port from the job id, run dir
    per job id (stable across requeues, so resume is automatic), one agent per node."""
    r = run_script([SBATCH, "--dry-run", "--algorithm.steps=3"],
                   launch_env(SLURM_JOB_NUM_NODES="4", CONFIG=CONFIGS["qwen2.5_32b"][0]))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "--nnodes 4 --nproc-per-node 8" in out and "--algorithm.steps=3" in out
    assert f"--checkpoint.dir={REPO}/runs/grpo-mega-0/checkpoints" in out
    srun = out.strip().splitlines()[-1]
    assert srun.startswith("srun --nodes=4 --ntasks-per-node=1 --kill-on-bad-exit=1")
    assert "NODE_RANK=\\$SLURM_NODEID" in srun and "node%n.attempt0.out" in srun


def test_gpu_ready_launchers_pass_cpus_per_task_and_count_visible_gpus(tmp_path):
    """Guards against issue 27's defect 8 in the launchers: grpo.sbatch's srun without
    --cpus-per-task (Slurm >= 22.05 no longer passes the job's on, so each node's agent and
    its ranks run bound to one CPU), and torchrun.sh counting the node's GPUs with
    ``nvidia-smi -L`` although CUDA_VISIBLE_DEVICES gives this job fewer (ranks on GPUs it
    may not use). A stand-in nvidia-smi on PATH lists 8 GPUs."""
    r = run_script([SBATCH, "--dry-run"], launch_env(SLURM_JOB_NUM_NODES="2", SLURM_CPUS_PER_TASK="96",
                                                     CONFIG=CONFIGS["qwen2.5_32b"][0]))
    assert r.returncode == 0, r.stderr
    assert "--cpus-per-task=96" in r.stdout.strip().splitlines()[-1]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: H100 (UUID: x)\"; done\n")
    (fake / "nvidia-smi").chmod(0o755)
    path = f"{fake}{os.pathsep}{os.environ['PATH']}"
    for visible, nproc in ((None, 8), ("2,5", 2), ("7", 1)):
        env = launch_env(PATH=path, ENTRY="grpo_mega.train")
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        r = run_script([TORCHRUN_SH, "--dry-run"], env)
        assert r.returncode == 0, r.stderr
        assert f"--nproc-per-node {nproc}" in r.stdout, (visible, r.stdout)


# ------------------------------------------------------------- real torchrun launches

@pytest.mark.slow
def test_two_node_rendezvous_runs_job_at_world_2(tmp_path):
    """Two torchrun agents, started as separate processes with --nnodes 2 and node ranks
    0/1, must rendezvous on 127.0.0.1 through c10d and run the job at world size 2 (TP=2
    spans both "nodes"), both exiting 0."""
    entry, config, args, ok = JOB
    port = free_port()
    logs = [tmp_path / f"node{i}.log" for i in (0, 1)]
    agents = [start_agent(i, port, logs[i], entry, config, args) for i in (0, 1)]
    try:
        rcs = [a.wait(timeout=300) for a in agents]
    finally:
        for a in agents:
            kill_group(a)
    out = [log.read_text() for log in logs]
    assert rcs == [0, 0], "\n".join(out)
    both = "\n".join(out)
    assert ok in both, both
    assert "node 0/2 x 1 ranks (world 2)" in out[0] and "node 1/2 x 1 ranks (world 2)" in out[1]


@pytest.mark.slow
def test_dead_node_makes_peer_exit_within_collective_timeout(tmp_path):
    """A node that dies mid-job must not leave the others hanging: after node 1's process
    group is SIGKILLed, node 0's rank (blocked in an all-reduce node 1 never joins) fails at
    --parallel.timeout_minutes and its torchrun agent exits non-zero."""
    timeout_s = 15
    port = free_port()
    logs = [tmp_path / f"node{i}.log" for i in (0, 1)]
    args = [f"--parallel.timeout_minutes={timeout_s / 60}"]
    agents = [start_agent(0, port, logs[0], COLLECTIVE, "", args),
              start_agent(1, port, logs[1], COLLECTIVE, "", args, LAUNCH_COLLECTIVE_ROLE="victim")]
    try:
        deadline = time.time() + 120
        while not all("ready" in log.read_text() for log in logs):
            assert time.time() < deadline and all(a.poll() is None for a in agents), \
                "\n".join(log.read_text() for log in logs)
            time.sleep(0.2)
        os.killpg(agents[1].pid, signal.SIGKILL)
        t_kill = time.time()
        rc = agents[0].wait(timeout=timeout_s + 60)
        elapsed = time.time() - t_kill
    finally:
        for a in agents:
            kill_group(a)
    out = logs[0].read_text()
    assert rc != 0, out
    assert elapsed < timeout_s + 30, (elapsed, out)
    assert "collective failed" in out and "ChildFailedError" in out, out


# ------------------------------------------------------------------------ real Slurm

SLURM_PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
SLURM_BINARIES = ["slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "munged"]


def _ensure_slurm_installed() -> None:
    """Install Slurm and munge from Debian packages when missing, or skip saying why."""
    if all(shutil.which(b) for b in SLURM_BINARIES):
        return
    missing = [b for b in SLURM_BINARIES if not shutil.which(b)]
    if os.geteuid() != 0:
        pytest.skip(f"Slurm binaries {missing} are not installed, and installing "
                    f"{SLURM_PACKAGES} needs root (running as uid {os.geteuid()})")
    if not shutil.which("apt-get"):
        pytest.skip(f"Slurm binaries {missing} are not installed and apt-get is not available")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", *SLURM_PACKAGES]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:  # stale package lists: refresh once
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=300)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0 or not all(shutil.which(b) for b in SLURM_BINARIES):
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        pytest.skip(f"could not install {SLURM_PACKAGES} with apt-get (exit {r.returncode}): {tail}")


class SlurmCluster:
    """A real single-node Slurm cluster (munged, slurmctld, slurmd) under one directory.

    Nothing outside ``root`` is touched: SLURM_CONF points at our own slurm.conf, munge
    runs on its own key and socket, and every state/spool/pid/log file lives in root.
    """

    def __init__(self, root: Path):
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def _spawn(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, env=self.env, stdout=(self.root / f"{name}.out").open("w"),
                             stderr=subprocess.STDOUT, **kw)
        self.procs.append(p)
        return p

    def log(self, name: str) -> str:
        parts = []
        for f in (f"{name}.out", f"{name}.log"):
            if (self.root / f).exists():
                parts.append((self.root / f).read_text()[-2000:])
        return "\n".join(parts)

    def start(self) -> None:
        os.chmod(self.root, 0o755)
        munge = pwd.getpwnam("munge")
        mdir = self.root / "munge"  # owned by munge, 0755: munged checks both
        mdir.mkdir()
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(1024))
        for p in (mdir, key):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        os.chmod(mdir, 0o755)
        os.chmod(key, 0o400)
        sock = mdir / "munge.socket"
        munged = self._spawn("munged", [
            "munged", "--foreground", f"--socket={sock}", f"--key-file={key}",
            f"--pid-file={mdir}/munged.pid", f"--log-file={mdir}/munged.log",
            f"--seed-file={mdir}/munged.seed"], user="munge", group="munge", extra_groups=[])
        self._wait(lambda: sock.exists(), munged, "munged", 20)

        for d in ("state", "spool"):
            (self.root / d).mkdir()
        r = self.root
        self.conf.write_text("\n".join([
            "ClusterName=grpotest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={sock}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/slurmctld.log", f"SlurmdLogFile={r}/slurmd.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MailProg=/bin/true", "SchedulerParameters=batch_sched_delay=0", "MinJobAge=300",
            "ReturnToService=2",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            ""]))
        ctld = self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        slurmd = self._spawn("slurmd", ["slurmd", "-D"])

        def idle():
            for p, name in ((ctld, "slurmctld"), (slurmd, "slurmd")):
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}: {self.log(name)}")
            s = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            return s.stdout.strip() == "idle"
        self._wait(idle, None, "the node to become idle", 60)

    def _wait(self, ready, proc, what, timeout):
        deadline = time.time() + timeout
        while not ready():
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}: {self.log(what)}")
            if time.time() > deadline:
                raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.1)

    def stop(self) -> None:
        for p in reversed(self.procs):  # slurmd, slurmctld, then munged; by recorded PID
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


@pytest.fixture(scope="module")
def slurm():
    _ensure_slurm_installed()
    if os.geteuid() != 0:
        pytest.skip(f"slurmctld/slurmd must run as root and munged as munge; running as uid {os.geteuid()}")
    # Not pytest's tmp_path: its parent is 0700, and munged (as munge) must reach its files.
    root = Path(tempfile.mkdtemp(prefix="grpo-slurm-"))
    cluster = SlurmCluster(root)
    try:
        cluster.start()
    except (RuntimeError, OSError, KeyError) as e:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"real Slurm could not start here: {e}")
    yield cluster
    cluster.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_sbatch_template_runs_job_on_real_slurm(slurm, tmp_path):
    """Submit launch/slurm/grpo.sbatch unchanged (command-line options only shrink the
    resources to this 2-CPU, GPU-less node) with sbatch --wait: srun starts one torchrun
    agent on the node, which runs the job at world 2; logs land in the run dir per job id."""
    entry, config, args, ok = JOB
    env = launch_env(SLURM_CONF=str(slurm.conf), ENTRY=entry, CONFIG=config, NPROC_PER_NODE="2",
                     RUN_ROOT=str(tmp_path / "runs"), MASTER_PORT=str(free_port()))
    t0 = time.time()
    cmd = ["sbatch", "--wait", "--parsable", f"--output={tmp_path}/%x-%j.out", "--nodes=1",
           "--cpus-per-task=2", "--gpus-per-node=0", "--time=10", str(SBATCH), *args]
    try:
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--user=root"], env=slurm.env)
        raise
    job_id = r.stdout.strip().split(";")[0]
    run_dir = tmp_path / "runs" / f"grpo-mega-{job_id}"
    batch_out = (tmp_path / f"grpo-mega-{job_id}.out")
    node_log = run_dir / "logs" / "node0.attempt0.out"
    report = "\n".join(f"--- {p}\n{p.read_text()}" for p in (batch_out, node_log) if p.exists())
    assert r.returncode == 0, f"sbatch rc {r.returncode}: {r.stderr}\n{report}\n{slurm.log('slurmd')}"
    info = subprocess.run(["scontrol", "show", "job", job_id], env=slurm.env, capture_output=True,
                          text=True).stdout
    assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, info
    assert f"job {job_id} attempt 0: 1 node(s) x 2 ranks" in batch_out.read_text()
    assert "srun exited with 0" in (run_dir / "logs" / "job.out").read_text()
    assert ok in node_log.read_text(), report
    assert "node 0/1 x 2 ranks (world 2)" in node_log.read_text()
    assert (run_dir / "checkpoints").is_dir()
    print(f"[slurm] job {job_id} took {time.time() - t0:.1f}s")


def _port_kept_free() -> int:
    """A free port below the kernel's ephemeral range, for a rendezvous port that must still
    be free a minute later (the requeued attempt reuses it). ``free_port`` picks from the
    ephemeral range, where the suite's other launches pick theirs and outgoing connections
    get theirs: in a whole-suite run of 2026-11-28 the requeued attempt found its port held
    by another TCPStore ("Connection reset by peer")."""
    import random

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(20000, max(low, 20001)), min(200, max(low - 20000, 1))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    return free_port()


@pytest.mark.slow
def test_sbatch_requeue_near_time_limit_resumes_in_same_run_dir(slurm, tmp_path):
    """Requeue-safety: the USR1 that --signal sends before the time limit must make the
    template requeue its own job, and the next attempt (same job id) must find the
    previous attempt's checkpoint in the same run directory. The signal is sent with
    scancel instead of waiting for the limit, and Slurm's ~2 min requeue delay is
    lifted with StartTime=now; the entry is a stand-in trainer (tests/scripts/launch_resume.py)."""
    env = launch_env(SLURM_CONF=str(slurm.conf), ENTRY="tests/scripts/launch_resume.py", CONFIG="",
                     NPROC_PER_NODE="1", RUN_ROOT=str(tmp_path / "runs"), MASTER_PORT=str(_port_kept_free()))
    r = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/%x-%j.out", "--nodes=1",
                        "--cpus-per-task=2", "--gpus-per-node=0", "--time=10", str(SBATCH)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]
    logs = tmp_path / "runs" / f"grpo-mega-{job_id}" / "logs"

    def state() -> str:
        out = subprocess.run(["scontrol", "show", "job", job_id], env=slurm.env, capture_output=True,
                             text=True).stdout
        return out.split("JobState=")[1].split()[0] if "JobState=" in out else "UNKNOWN"

    def wait_for(cond, what, timeout=120):
        deadline = time.time() + timeout
        while not cond():
            if time.time() > deadline:
                subprocess.run(["scancel", job_id], env=slurm.env)
                found = "\n".join(f"--- {f}\n{f.read_text()}" for f in sorted(logs.glob("*"))) if logs.exists() else ""
                pytest.fail(f"timed out waiting for {what}; job state {state()}\n{found}")
            time.sleep(0.2)

    first = logs / "node0.attempt0.out"
    wait_for(lambda: first.exists() and "saved" in first.read_text(), "attempt 0 to save")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm.env, check=True)
    # Requeued: PENDING (Reason=BeginTime), or already past it on a Slurm without the delay.
    wait_for(lambda: state() == "PENDING" or "attempt 1" in (logs / "job.out").read_text(),
             "the job to be requeued")
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=slurm.env)
    wait_for(lambda: state() in ("COMPLETED", "FAILED", "CANCELLED"), "attempt 1 to finish")
    job_out = (logs / "job.out").read_text()
    assert state() == "COMPLETED", job_out
    assert "time limit near: requeueing" in job_out
    assert f"job {job_id} attempt 1" in job_out and "srun exited with 0" in job_out
    second = (logs / "node0.attempt1.out").read_text()
    assert f"attempt 1 resumed from {logs.parent}/checkpoints/latest.txt: step 7 of job {job_id} attempt 0" in second
