"""An agent program the trainer trains through the gateway: plain ``openai`` code, a tool loop.

The tool demo's task (``grpo_mega.demo.tools``: ``"37*45="`` -> ``1665``) played by an
ordinary tool-calling agent (act, observe, answer): it asks the model with a
``calculator`` tool, runs the calls the model makes, sends the results back, and scores
the final answer against the reference. Nothing of the trainer is imported: it talks to
the gateway over HTTP only, so any agent written for the ``openai`` client can take its
place.

The trainer starts it (``gateway.agent_command``) with ``GRPO_GATEWAY_URL`` and
``GRPO_GATEWAY_API_KEY`` in its environment; it asks ``POST /tasks/next`` for episodes,
plays ``GRPO_AGENT_WORKERS`` of them side by side (default 32), reports each reward with
``POST /episodes/<id>/finish``, and exits when the gateway answers 410 (the run is over).

    python -m grpo_mega.train --config grpo_mega/configs/demo_gateway.yaml ...   # starts it
    GRPO_GATEWAY_URL=... GRPO_GATEWAY_API_KEY=... python -m grpo_mega.demo.gateway_agent  # by hand
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Multiply two whole numbers: '37*45'.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
MAX_TURNS = 2


def calculator(expression: str) -> str:
    a, _, b = expression.partition("*")
    return str(int(a) * int(b)) if a.isdigit() and b.isdigit() else "error"


def play(client, task: dict) -> float:
    """One episode: the agent's own loop; its reward is 1.0 for the exact product."""
    messages = list(task["messages"])
    answer = ""
    for _ in range(MAX_TURNS):
        # No temperature, seed or max_tokens: the trainer owns the sampling.
        reply = client.chat.completions.create(model="any", messages=messages, tools=TOOLS)
        choice = reply.choices[0]
        messages.append(choice.message)  # the reply exactly as returned
        if choice.finish_reason != "tool_calls":
            answer = choice.message.content or ""
            break
        for call in choice.message.tool_calls:
            result = calculator(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return float(answer.strip() == str(task["answer"]).strip())


def _post(url: str, key: str, body: dict, timeout: float = 90.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def worker(url: str, key: str, stop: threading.Event) -> None:
    import openai

    while not stop.is_set():
        try:
            task = _post(f"{url}/tasks/next", key, {"wait": 5})
        except urllib.error.HTTPError as e:
            if e.code == 410:  # the run is over
                stop.set()
                return
            time.sleep(1.0)  # 503: the gateway is at its connection cap; ask again
            continue
        except urllib.error.URLError:  # the trainer is gone
            stop.set()
            return
        if task.get("episode_id") is None:
            continue
        # One client per episode (its base_url names the episode), closed after it: each
        # holds a connection, and the gateway bounds those (gateway.max_connections).
        with openai.OpenAI(base_url=task["base_url"], api_key=key, max_retries=2) as client:
            try:
                reward = play(client, task)
            except openai.APIStatusError as e:  # a refused call ends the episode, reward 0
                print(f"[agent] episode {task['episode_id']}: {e.status_code} {e.message}", file=sys.stderr)
                reward = 0.0
        try:
            _post(f"{url}/episodes/{task['episode_id']}/finish", key, {"reward": reward})
        except urllib.error.HTTPError as e:  # 404/409: the trainer ended the episode (too slow)
            print(f"[agent] episode {task['episode_id']}: finish refused: {e.code}", file=sys.stderr)


def main() -> int:
    url, key = os.environ["GRPO_GATEWAY_URL"], os.environ["GRPO_GATEWAY_API_KEY"]
    stop = threading.Event()
    threads = [threading.Thread(target=worker, args=(url, key, stop), daemon=True)
               for _ in range(int(os.environ.get("GRPO_AGENT_WORKERS", "32")))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
