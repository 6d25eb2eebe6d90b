"""The trainer's side of gateway mode (``gateway.enabled``): an agent program plays the episodes.

Global rank 0 holds the OpenAI-compatible gateway (``grpo_mega.gateway``) on loopback and,
when ``gateway.agent_command`` is set, the agent process. Each rollout (a training step's,
a DAPO refill round's, an evaluation's) opens ``n`` episodes per prompt, each with a task
(the prompt's messages and reference answer) that the agent takes from ``POST
/tasks/next``; the agent plays it through ``/v1/chat/completions`` with its own loop and
reports the reward (``POST /episodes/<id>/finish``). Meanwhile every rank pumps: rank 0
takes the calls waiting in the gateway and broadcasts them, each engine replica generates
its share (so any engine layout the trainer runs serves them: TP > 1, several replicas,
lockstep replicas sampling a dummy when they have none), and rank 0 hands the samples back.
When every episode is finished the group-major batch is collected on rank 0, broadcast,
and cut for this DP replica like single-turn batches.

Outside a rollout nothing drives the engines: a call arriving while the trainer updates
and syncs weights waits in the gateway's queue (the engines are paused around the sync).
The trainer's sampling (``rollout.*``) is the gateway's; requests asking otherwise are
refused or overridden (``gateway.sampling_policy``).

Episodes never stop the run: one not finished within ``gateway.episode_timeout_seconds``
is ended by the trainer (``Gateway.expire``; a call of it being served still completes)
and scored ``gateway.error_reward``; with that None, or when an episode is not
token-exact, its whole group is dropped (every mask entry 0, ``episode_info["dropped"]``)
because the other episodes' advantages are relative to it. Only an agent program the
trainer started and that has exited stops the run (nobody would play the episodes).
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["GatewayRun", "build_gateway", "drop_groups", "play_gateway"]

log = logging.getLogger(__name__)

_POLL_S = 0.02
"""How long rank 0 waits for agents' calls before the ranks check in together again."""


class GatewayRun:
    """The gateway, its server and the agent process (rank 0; None elsewhere)."""

    def __init__(self, gateway: Any = None, server: Any = None, agent: Optional[subprocess.Popen] = None,
                 say=print):
        self.gateway, self.server, self.agent, self.say = gateway, server, agent, say
        self.rounds = 0
        self.served: list[int] = []
        """Calls served by each engine replica so far (rank 0; the log's closing line)."""

    def close(self) -> None:
        """End the tasks (the agent's next ask is a 410: it exits), stop the agent, the server."""
        if self.gateway is not None:
            self.say(f"gateway: calls served per engine replica: {self.served}")
            self.gateway.end_tasks()
        if self.agent is not None and self.agent.poll() is None:
            try:
                self.agent.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.agent.terminate()
                try:
                    self.agent.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.agent.kill()
        if self.server is not None:
            self.server.close()


def build_gateway(cfg, tokenizer, rank: int, say=print) -> Optional[GatewayRun]:
    """None unless ``gateway.enabled``; the server and agent on global rank 0."""
    g = cfg.gateway
    if not g.enabled:
        return None
    if rank != 0:
        return GatewayRun()
    from grpo_mega.gateway import Gateway, GatewayConfig
    from grpo_mega.rollout.chat_codec import ChatCodec

    codec = ChatCodec.for_tokenizer(tokenizer, g.chat_format)
    key = g.api_key or secrets.token_urlsafe(24)
    gateway = Gateway(None, codec, None, GatewayConfig(
        host=g.host, port=g.port, api_key=key, max_model_len=cfg.rollout.max_model_len,
        max_episode_tokens=g.max_tokens, sampling_policy=g.sampling_policy, on_rewrite=g.on_rewrite,
        auto_open=False, max_connections=g.max_connections, request_timeout_s=g.episode_timeout_seconds))
    server = gateway.serve()
    info = Path(cfg.logging.run_dir) / "gateway.json"
    info.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(info, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the key: the owner's only
    with os.fdopen(fd, "w") as f:
        json.dump({"url": server.url, "api_key": key}, f)
    agent = None
    if g.agent_command:
        env = dict(os.environ, GRPO_GATEWAY_URL=server.url, GRPO_GATEWAY_API_KEY=key)
        command = list(g.agent_command)
        if command[0] == "python":  # the trainer's own interpreter (its venv), not whatever PATH holds
            command[0] = sys.executable
        agent = subprocess.Popen(command, env=env)
    say(f"gateway: serving on {server.url} (key in {info}); "
        + (f"agent started: {' '.join(g.agent_command)} (pid {agent.pid})" if agent else
           "start the agent yourself (gateway.agent_command is empty)"))
    return GatewayRun(gateway, server, agent, say)


def _task(p) -> dict:
    """What the agent gets for a prompt: its messages (or text) and the reference answer."""
    messages = [dict(m) for m in p.messages] if p.messages else [{"role": "user", "content": p.text}]
    return {"prompt": p.text, "messages": messages, "answer": p.reference, "metadata": dict(p.metadata)}


def play_gateway(t, prompts: list, step: int, sampling=None, mini_batches: int = 1):
    """This DP replica's share of the rollout's episodes, played by the agent (a
    ``RolloutBatch``; ``t`` is the ``Trainer``). Collective over the world."""
    from grpo_mega.rollout.layout import prompt_slice
    from grpo_mega.rollout.types import RolloutBatch

    run, s = t.gateway, sampling or t.engine.sampling
    n, ids = s.n, []
    if run.gateway is not None:
        run.rounds += 1
        run.gateway.set_sampling(s)
        run.gateway.step = step
        for i, p in enumerate(prompts):
            for j in range(n):
                ids.append(run.gateway.open_episode(f"s{step}r{run.rounds}p{i}e{j}", prompt_index=i, key=i * n + j,
                                                    task=_task(p)))
    t.engine.resume()
    g = t.cfg.gateway
    _pump(t, run, ids, g.episode_timeout_seconds)
    box = [drop_groups(run.gateway.collect(ids, group_size=n, error_reward=g.error_reward), g.error_reward).to_dict()
           if run.gateway is not None else None]
    if t.ps.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return prompt_slice(RolloutBatch.from_dict(box[0]), len(prompts), t.ps.dp_rank, t.ps.dp, mini_batches)


def drop_groups(batch, error_reward: Optional[float]):
    """Drop from training (every mask entry 0, ``episode_info["dropped"] = 1``) each group
    of ``batch.group_size`` episodes holding one that is not token-exact or, with
    ``error_reward`` None, one the trainer ended (``info["error"]``); returns ``batch``."""
    g = batch.group_size
    bad = {k // g for k, info in enumerate(batch.episode_info)
           if info.get("token_mismatch") or (info.get("error") is not None and error_reward is None)}
    for k, info in enumerate(batch.episode_info):
        info["dropped"] = int(k // g in bad)
        if info["dropped"]:
            batch.response_mask[k] = [0] * len(batch.response_mask[k])
    if bad:
        log.warning("gateway: %d of %d groups dropped from training (an episode not token-exact, or ended "
                    "with gateway.error_reward=None)", len(bad), len(batch.episode_info) // g)
    return batch


def _pump(t, run: GatewayRun, ids: list[str], timeout: float) -> None:
    """Serve the agents' calls until every episode in ``ids`` is finished and none has a
    call being served (all ranks). Past ``timeout`` the unfinished ones are ended."""
    world, deadline = t.ps.world_size, time.monotonic() + timeout
    while True:
        msg: dict = {}
        if run.gateway is not None:
            gw = run.gateway
            jobs = gw.batcher.take(_POLL_S)
            left = gw.unfinished(ids)
            if left and time.monotonic() > deadline:  # checked while calls keep coming too
                ended = gw.expire(left, f"not finished within gateway.episode_timeout_seconds={timeout}")
                log.warning("gateway: %d episodes not finished within gateway.episode_timeout_seconds=%s were "
                            "ended, scored gateway.error_reward (e.g. %s)", len(ended), timeout, ended[:3])
                left = []
            if not jobs and not left:  # ended episodes' calls already taken still complete
                left = gw.busy(ids)
            exited = run.agent.poll() if run.agent is not None else None
            msg = {"jobs": [(j.prompt, j.sampling, j.step, j.key, j.budget) for j in jobs],
                   "done": not jobs and not left, "exited": exited}
        if world > 1:
            box = [msg]
            dist.broadcast_object_list(box, src=0)
            msg = box[0]
        if msg["done"]:
            return
        if msg["exited"] is not None:
            raise RuntimeError(f"gateway: the agent program (gateway.agent_command) exited with code "
                               f"{msg['exited']} while {len(ids)} episodes were being played; nobody will "
                               "finish them (see its output above)")
        if msg["jobs"]:
            results = _generate(t, msg["jobs"])
            if run.gateway is not None:
                _deliver(jobs, results)


def _generate(t, specs: list[tuple]) -> dict[int, Any]:
    """Each engine replica samples its share of the calls (one generate per sampling and
    step); rank 0 gets ``{index: Sampled fields or (error type, message)}``."""
    from grpo_mega.gateway.batcher import sampled

    engine, out_all = t.engine, {}
    groups: dict[tuple, list[int]] = {}
    for k, (_, s, step, _, _) in enumerate(specs):
        groups.setdefault((s, step), []).append(k)
    for (s, step), idx in groups.items():
        mine = idx[engine.dp_rank::engine.dp_size]
        try:
            if mine:
                out = engine.generate([specs[k][0] for k in mine], s, step=step, keys=[specs[k][3] for k in mine],
                                      budgets=[specs[k][4] for k in mine])
                share = out.seconds / len(mine)
                out_all.update({k: vars(sampled(out, i, share)) for i, k in enumerate(mine)})
            elif engine.lockstep:  # vLLM's data-parallel launcher: every replica samples together
                engine.generate([specs[idx[0]][0]], s, step=step, keys=[0], budgets=[1])
        except Exception as e:  # noqa: BLE001 - answered to the calls (the gateway names it)
            out_all.update({k: (type(e).__name__, str(e)) for k in mine})
    if t.ps.world_size == 1:
        _count(t.gateway, 0, len(out_all))
        return out_all
    leads = t.ps.rank == engine.replica_leader
    gathered: Optional[list] = [None] * t.ps.world_size if t.ps.rank == 0 else None
    dist.gather_object((engine.dp_rank, out_all) if leads else None, gathered, dst=0)
    merged: dict[int, Any] = {}
    for part in gathered or []:
        if part is not None:
            merged.update(part[1])
            _count(t.gateway, part[0], len(part[1]))
    return merged


def _count(run: GatewayRun, replica: int, n: int) -> None:
    run.served += [0] * (replica + 1 - len(run.served))
    run.served[replica] += n


def _deliver(jobs: list, results: dict[int, Any]) -> None:
    from grpo_mega.gateway.batcher import Sampled

    for k, job in enumerate(jobs):
        got = results.get(k)
        if isinstance(got, dict):
            job.future.set_result(Sampled(**got))
        else:
            kind, message = got if got is not None else ("RuntimeError", "no engine replica answered the call")
            job.future.set_exception(ValueError(message) if kind == "ValueError" else RuntimeError(message))
