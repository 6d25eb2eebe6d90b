"""What every metric the trainer logs means, with its unit: the one list the docs'
metrics glossary is generated from (``tools/gen_docs.py``) and the integration tests hold
``metrics.jsonl`` to (a logged key missing here fails them).

Each row of ``metrics.jsonl`` is one step (``step`` 0 holds the initial evaluation only).
Per-token metrics are means over the step's response tokens on every DP replica; reward
metrics are means over the step's samples. Imports nothing.
"""
from __future__ import annotations

# name -> (unit, meaning)
METRICS: dict[str, tuple[str, str]] = {
    "step": ("count", "GRPO step; 0 is the evaluation before training"),
    "time": ("Unix seconds", "wall-clock time the row was written"),
    # rollout and reward (stage reward), over every trained sample of the step (every DAPO round;
    # not the groups dropped from training, which episodes_dropped counts)
    "reward_mean": ("reward", "mean total reward of the step's trained samples (weighted sum of "
                              "reward.functions; dropped groups left out)"),
    "reward_std": ("reward", "standard deviation of the samples' total rewards"),
    "accuracy": ("fraction", "share of samples whose reward is >= 1 (solved)"),
    "response_len": ("tokens", "mean response length"),
    "truncated_frac": ("fraction", "share of responses cut at rollout.max_new_tokens"),
    "reward_failures": ("count", "samples whose reward function raised or timed out (scored 0 under "
                                 "reward.on_error=zero)"),
    # multi-turn episodes (env.name set), means per episode
    "episode_turns": ("count", "assistant turns per episode"),
    "episode_tool_calls": ("count", "tool calls the model made per episode"),
    "episode_tool_errors": ("count", "tool calls per episode that gave the model an error (bad call, crash, "
                                     "timeout, limit)"),
    "token_mismatch": ("count", "token-exact problems per episode: the trajectory's ids differ from the chat "
                                "template's rendering (0 by construction; anything else is a bug)"),
    "episode_env_tokens": ("tokens", "tokens per episode appended from the environment (never trained on)"),
    "episode_env_errors": ("fraction", "share of episodes ended by their environment's error (step raised, "
                                       "outlasted env.step_timeout_seconds or the turn budget; gateway mode: "
                                       "not finished within gateway.episode_timeout_seconds); reward "
                                       "env.error_reward (gateway.error_reward), the run goes on"),
    "episodes_dropped": ("fraction", "share of episodes not trained on: their group held an episode that is "
                                     "not token-exact (or an environment error under env.error_reward=null, "
                                     "a timed-out agent under gateway.error_reward=null); "
                                     "every token's loss mask 0"),
    # DAPO dynamic sampling (algorithm.dynamic_sampling)
    "dapo_rounds": ("count", "sampling rounds this step took"),
    "groups_used": ("count", "groups with a reward spread trained on"),
    "groups_dropped": ("count", "groups dropped because all their rewards were equal"),
    "groups_spare": ("count", "groups with a spread beyond the batch (or the DP cut), dropped"),
    "empty_step": ("flag (1)", "no group had a reward spread: no update, the scheduler did not advance"),
    # asynchronous GRPO (algorithm.max_staleness; grpo_mega/trainer/staleness.py), over the trained samples
    "staleness_frac_<k>": ("fraction", "share of the trained response tokens sampled k policy versions before "
                                       "the weights the update starts from, one key per k = 0 .. "
                                       "algorithm.max_staleness"),
    "staleness_mean": ("versions", "mean staleness (update's version - token's version) of the trained tokens"),
    "versions_spanned_mean": ("versions", "mean over trajectories of newest - oldest token version + 1 (above 1: "
                                          "weights were updated while the response was generated)"),
    "versions_spanned_max": ("versions", "most versions one trajectory spanned"),
    "stale_groups_dropped": ("count", "groups with a token past the staleness bound, dropped; their prompts "
                                      "are sampled again"),
    "staleness_bound_violations": ("count", "trained tokens past the staleness bound (0 by construction; the "
                                            "guard before the update stops the run otherwise)"),
    # the update (stage update), means over response tokens
    "loss": ("nats / token", "the GRPO loss as optimised: surrogate plus kl_coef x KL, aggregated by "
                             "algorithm.loss_agg"),
    "kl": ("nats / token", "KL(policy || reference) estimate of algorithm.kl_kind, before kl_coef"),
    "entropy": ("nats / token", "entropy of the policy's sampling distribution (logits / T)"),
    "clipfrac_low": ("fraction", "tokens with a negative advantage whose ratio fell below 1 - clip_low"),
    "clipfrac_high": ("fraction", "tokens with a positive advantage whose ratio rose above 1 + clip_high"),
    "clipfrac": ("fraction", "clipfrac_low + clipfrac_high"),
    "dual_clipfrac": ("fraction", "tokens clipped by the dual clip (algorithm.dual_clip set)"),
    "ratio_mean": ("ratio", "mean importance ratio pi_theta / pi_old (1 on-policy)"),
    "rollout_logp_gap": ("nats / token", "mean |trainer log-prob - vLLM log-prob| of the sampled tokens: "
                                         "engine/trainer mismatch (and top-p/top-k truncation)"),
    "pad_frac": ("fraction", "share of the positions the update's passes computed that were padding "
                             "(rows padded to their micro-batch's longest; with parallel.packing only the "
                             "tail FP8 / sequence parallelism needs)"),
    "tokens_per_micro_batch": ("tokens", "mean prompt + response tokens per micro-batch of the update, over "
                                         "every DP replica (parallel.micro_batch_size rows, or binned under "
                                         "parallel.max_tokens_per_micro_batch)"),
    "tis_weight_mean": ("ratio", "mean behaviour weight proximal / behaviour of the decoupled objective after "
                                 "the cap (algorithm.tis_cap set, or max_staleness >= 1; masked tokens count 0)"),
    "tis_clipfrac": ("fraction", "tokens whose importance weight passed the cap: clamped to it, or masked "
                                 "out under algorithm.tis_mode=mask (the default with max_staleness >= 1)"),
    "grad_norm": ("L2 norm", "global gradient norm before clipping (over TP, PP and DP)"),
    "skipped": ("flag (0/1)", "1 when the update was skipped for a non-finite gradient norm"),
    # after the update
    "sync_gbps": ("GB/s", "weight sync throughput into the rollout engine (HF bytes / sync seconds)"),
    "engine_paused_s": ("seconds", "rollout.placement=separate: how long the engines' requests in flight "
                                   "waited for the weight update (slowest engine, first bucket to resume)"),
    "engine_load_s": ("seconds", "of engine_paused_s, loading the received tensors into vLLM"),
    "tokens_per_s": ("tokens / s", "prompt + response tokens of the step (all DP replicas, unpadded) over the step's wall time"),
    "ref_reset": ("flag (1)", "iterative GRPO reset the KL reference to the policy after this step"),
    "eval_accuracy": ("fraction", "held-out accuracy: greedy (data.eval_samples=1) or pass@k"),
}

# stage -> meaning; each is logged as ``time/<stage>`` in seconds
STAGES: dict[str, str] = {
    "rollout": "sampling rollout.n responses per prompt from the engines (every DAPO round); asynchronous: "
               "waiting for the batch the engines drew during the previous update",
    "reward": "scoring the samples in the reward workers (every DAPO round)",
    "advantage": "group advantages and packing the TrainingBatch",
    "release": "putting the engine to sleep (rollout.sleep_between_rollouts) before training",
    "logprobs": "the reference (and old-policy) log-prob forwards",
    "update": "forward, backward and optimizer steps of the policy",
    "resume": "waking the engine up before the weight sync",
    "sync": "exporting the weights into the engines and verifying them",
    "submit": "asynchronous GRPO: drawing the next step's prompts and queueing them on the engines",
}


def is_documented(key: str) -> bool:
    """A ``metrics.jsonl`` key is in the glossary (``time/<stage>`` for a known stage)."""
    if key.startswith("time/"):
        return key[5:] in STAGES
    if key.startswith("staleness_frac_"):
        return key[len("staleness_frac_"):].isdigit()
    return key in METRICS
