"""Validate a config for a world size and print its layout and per-GPU memory budget.

Starts nothing: no process group, no GPU. It answers "will this
layout launch, and will it fit?" before a multi-node job queues for hours:

    python -m grpo_mega.preflight.budget --config launch/configs/llama3_70b.yaml
    python -m grpo_mega.preflight.budget --config launch/configs/llama3_8b.yaml --world-size 8 \\
        --parallel.tp=8 --parallel.dp=1
    launch/torchrun.sh --check-config          # the same, with CONFIG/NNODES/NPROC_PER_NODE

Options: ``--world-size N`` (default: tp x pp x dp from the config, dp=1 when it is 0),
``--gpus-per-node N`` (8), ``--gpu-memory-gib X`` (79.6, what an H100 80GB reports),
``--validate-only`` (validate, print two lines: the shape validated and where it came
from, then the layout; exit 0 or 2), ``--require-paths`` (the files a
training run reads: the data paths set and present, tokenizer files in ``model.hf_checkpoint``;
``launch/torchrun.sh`` adds it before it starts the trainer),
``--write-budget`` (rewrite the ``# @budget-begin`` ... ``# @budget-end`` comment block of the config
file), then ``--section.key=value`` overrides exactly as the trainer takes them.

A refusal is one line on stderr, exit 2: ``config error: ...`` for a config no world size can
run (a value, a YAML syntax error with its file, line and column, a missing data file, a
model folder without tokenizer files), ``layout error: ...`` for one this world size cannot
fill. The launcher passes the line through as it is.

The shape validated and budgeted is the trainer's: with ``model.hf_checkpoint`` set, the
checkpoint's ``config.json`` replaces the YAML's shape fields, as at start-up
(``preflight/shape.py``); without it, the YAML's own shape. The output names which.

The budget is an estimate for the worst pipeline stage of one GPU, in GiB:

* parameters: counted from the model shape (``params.py``: embedding, QKV(+bias), output
  projection, SwiGLU fc1 [gate; up] and fc2, RMSNorms, untied output layer), vocabulary padded
  as the model builder pads it; matrices are split over TP, norms are replicated. An MoE
  model's experts are split over EP x expert TP (= TP), its router is replicated like the norms.
* weights in ``model.dtype``; gradients in fp32 (megatron's main grads, whole on every
  rank in both optimizers: the distributed optimizers keep them in a flat buffer between
  steps, ``ParallelAdamW`` frees them after each step); with the grpo distributed optimizer
  also the reduced slice ``master.grad`` (4 B/param / dp, update only); Adam m and v in fp32
  plus an fp32 master copy when the weights are bf16 or the optimizer is distributed
  (12 B/param), divided over DP with ``optimizer.use_distributed_optimizer`` (experts' state
  over expert-DP = dp / ep only; ``optim/distributed.py``); a frozen reference copy when
  ``algorithm.kl_coef > 0`` (unless ``checkpoint.offload_reference``); Transformer Engine's
  FP8 weight caches with ``model.fp8`` (2 B/param: weight and transpose) and
  ``model.reference_fp8`` (1 B/param). ``model.lora``: adapter-only grads and state, no reference (lora_budget.py).
* activations (``activation_bytes``), with flash attention, per token and layer: ``4h``
  replicated (two norm inputs, QKV and fc1 inputs; ``/ tp`` with ``model.sequence_parallel``) plus
  ``((heads + 2 kv_heads) * head_dim + heads * head_dim + 3 ffn) / tp`` (q/k/v, attention
  output, fc1 output, SwiGLU output); times micro_batch x seq x layers/pp, times the
  micro-batches 1F1B keeps in flight on stage 0 (min(pp, micro-batches)). An MoE layer
  replaces the ``3 ffn / tp`` by its routed tokens' terms (``moe_activation_elements``).
* logits on the last stage: micro_batch x seq x vocab/tp in the model dtype plus three fp32
  buffers (upcast, log-softmax, gradient).
* the rollout engine (vLLM) takes ``rollout.gpu_memory_utilization`` of the GPU: its bf16
  weights at engine TP = ``rollout.tp`` (``parallel.tp`` when 0; engine replicas over the
  rest of the world, as the trainer places them; an MoE model's experts over engine TP x
  the replicas in ``external_launcher`` mode, where vLLM's MoE TP spans its DP), a fixed
  2 GiB for its activations and sampler, and the rest is KV cache.
* the peak is the largest of the phases (``phases.py``): rollout, reference, update,
  wake-up, sync and the checkpoint save (whose gather goes to host memory chunk by chunk,
  with the engine released), each with a 3 GiB reserve for the CUDA context, NCCL buffers
  and allocator fragmentation; while the engine sleeps its CUDA-graph pool stays.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional

from grpo_mega.config import Config, ConfigError, ModelConfig, derived_dp, load_config, rollout_tp
from grpo_mega.preflight.lora_budget import apply_lora
from grpo_mega.preflight.shape import describe_shape, model_shape_from_hf
from grpo_mega.preflight.params import ParamCount, count_params, head_dim, padded_vocab
from grpo_mega.preflight.phases import (CUDA_GRAPH_POOL_GIB, RUNTIME_RESERVE_GIB, SAVE_GATHER_GIB, Row,
                                        graph_pool_gib, phase_rows)
from grpo_mega.preflight.paths import check_paths
from grpo_mega.preflight.validate import validate

__all__ = ["ParamCount", "count_params", "head_dim", "padded_vocab", "derive_layout", "memory_budget",
           "activation_bytes", "report", "main", "RUNTIME_RESERVE_GIB", "CUDA_GRAPH_POOL_GIB"]

GiB = float(1 << 30)
ENGINE_OVERHEAD_GIB = 2.0
"""vLLM activations, sampler logits and CUDA graphs, inside its share beside weights and KV cache."""
GPU_GIB = 79.6
"""The default card: what an H100 80GB reports (81,559 MiB); ``--gpu-memory-gib`` for others."""
_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass
class Budget:
    """Per-GPU memory estimate; see the module docstring for every assumption."""

    gpu_gib: float
    trainer: list[Row] = field(default_factory=list)
    engine: list[Row] = field(default_factory=list)
    phases: list[Row] = field(default_factory=list)
    """Each phase of a step and the save (``phases.py``), in the order they run."""
    host_save_gib: float = 0.0
    """Host memory per rank the save's gathered optimizer state takes (DP-sharded optimizers)."""
    kv_tokens: int = 0
    kv_seqs: int = 0
    seqs_per_engine: int = 0
    engine_tp: int = 1

    @property
    def peak_gib(self) -> float:
        return max(p.gib for p in self.phases)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: p.gib).name

    @property
    def rollout_phase_gib(self) -> float:
        return self.phase("rollout")

    @property
    def training_phase_gib(self) -> float:
        return self.phase("update")

    @property
    def wake_up_gib(self) -> float:
        return self.phase("wake-up")

    @property
    def headroom_gib(self) -> float:
        return self.gpu_gib - self.peak_gib

    @property
    def fits(self) -> bool:
        return self.headroom_gib >= 0 and self.kv_tokens > 0

    def row(self, name: str) -> float:
        for r in self.trainer + self.engine:
            if r.name == name:
                return r.gib
        raise KeyError(name)

    def phase(self, name: str) -> float:
        for r in self.phases:
            if r.name == name:
                return r.gib
        raise KeyError(name)


@dataclass
class Layout:
    world: int
    tp: int
    pp: int
    dp: int
    gpus_per_node: int
    seq_len: int
    samples_per_step: int
    mini_batch: int
    micro_batches: int
    """Micro-batches per DP rank per optimizer step."""
    ep: int = 1
    """Expert-parallel size, carved out of the DP ranks; expert-DP is ``dp / ep``."""

    @property
    def nodes(self) -> int:
        return -(-self.world // self.gpus_per_node)

    @property
    def bubble(self) -> float:
        """1F1B pipeline bubble fraction: (pp - 1) / (m + pp - 1)."""
        return (self.pp - 1) / (self.micro_batches + self.pp - 1)


def derive_layout(cfg: Config, world: int, gpus_per_node: int = 8) -> Layout:
    p, d, r = cfg.parallel, cfg.data, cfg.rollout
    dp = derived_dp(cfg, world)
    samples = d.prompts_per_step * r.n
    mini = d.mini_batch_size or samples
    seq = d.max_prompt_tokens + r.max_new_tokens
    # under a token budget, the most micro-batches: every row at full length
    rows = max(p.max_tokens_per_micro_batch // seq, 1) if p.max_tokens_per_micro_batch else p.micro_batch_size
    return Layout(world=world, tp=p.tp, pp=p.pp, dp=dp, gpus_per_node=gpus_per_node,
                  seq_len=seq, samples_per_step=samples,
                  mini_batch=mini, micro_batches=max(-(-mini // dp) // rows, 1), ep=p.ep)


def micro_batch_tokens(cfg: Config, layout: Layout) -> tuple[int, str]:
    """(the most tokens a micro-batch computes, what bounds it): the token budget
    (``parallel.max_tokens_per_micro_batch``), else rows x the longest sequence (packed or not:
    a micro-batch of full-length rows has no padding to drop)."""
    p = cfg.parallel
    if p.max_tokens_per_micro_batch:
        return p.max_tokens_per_micro_batch, f"of {p.max_tokens_per_micro_batch}"
    return p.micro_batch_size * layout.seq_len, f"{p.micro_batch_size} x {layout.seq_len}"


def moe_activation_elements(m: ModelConfig, tp: int) -> float:
    """Stored activation elements per token of a micro-batch in one MoE layer, in place of
    the dense MLP's ``3 ffn / tp``: each token reaches ``moe_router_topk`` experts, and at
    TP > 1 without sequence parallelism the dispatcher gathers all tp copies of it to the
    TP-sharded experts (``models.gpt.allow_moe_without_sequence_parallel``), so a rank's
    experts see ``topk x tp`` routed tokens. Per routed token: the experts' fc1 and SwiGLU
    outputs (``3 moe_ffn / tp``) and the dispatcher's permuted buffers, the experts' input
    and their output before the probability-weighted unpermute (``2h``). Plus the
    router's fp32 logits and probabilities (``2 num_experts`` fp32, counted in elements of
    ``model.dtype``)."""
    copies = tp if tp > 1 and not m.sequence_parallel else 1
    routed = m.moe_router_topk * copies
    return (routed * (3 * m.moe_ffn_hidden_size / tp + 2 * m.hidden_size)
            + 2 * m.num_experts * 4 / _BYTES[m.dtype])


def activation_bytes(m: ModelConfig, tp: int, pp: int, inflight: int) -> float:
    """Stored activation elements per token of a micro-batch on the worst stage (times
    the dtype's bytes and the tokens gives bytes). Per layer without recompute: ``4h``
    outside the TP-split blocks (``/ tp`` with sequence parallelism) plus the q/k/v,
    attention output, fc1 and SwiGLU outputs split over TP (an MoE layer: the routed
    tokens' terms, ``moe_activation_elements``); flash attention keeps no
    [s, s] scores, so ``selective`` (core attention recomputed) changes nothing here.
    ``full``: each layer keeps only its input (``h``, ``/ tp`` with SP) for the micro-batches
    in flight, plus one chunk of ``recompute_num_layers`` layers re-run whole in the backward."""
    hd = head_dim(m)
    sp = tp if m.sequence_parallel and tp > 1 else 1
    mlp = moe_activation_elements(m, tp) if m.num_experts else 3 * m.ffn_hidden_size / tp
    per_layer = 4 * m.hidden_size / sp + (
        (m.num_attention_heads + 2 * m.num_query_groups) * hd + m.num_attention_heads * hd) / tp + mlp
    layers = m.num_layers // pp
    if m.recompute == "full":
        return m.hidden_size / sp * layers * inflight + per_layer * m.recompute_num_layers
    return per_layer * layers * inflight


def memory_budget(cfg: Config, layout: Layout, gpu_gib: float = GPU_GIB) -> Budget:
    m, p, r, o = cfg.model, cfg.parallel, cfg.rollout, cfg.optimizer
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    wb = _BYTES[m.dtype]
    ep = layout.ep
    pc = count_params(m, tp, pp, ep)
    n = pc.worst_stage
    b = Budget(gpu_gib=gpu_gib)

    dist_opt = o.use_distributed_optimizer and dp > 1
    # Expert grads are reduced over the expert-DP group (the DP ranks holding the same
    # experts), so a distributed optimizer shards expert state over dp / ep of them.
    edp = dp // ep if dist_opt else 1
    # DistributedAdamW keeps an fp32 master slice even for fp32 weights (the weights are
    # all-gathered from it), so it is 12 B/param / dp in either dtype.
    master = wb < 4 or o.use_distributed_optimizer
    opt_bytes = 8 + (4 if master else 0)
    dense, experts = pc.worst_stage_dense, pc.stage_experts
    moe = (f" ({dense / 1e9:.2f}B dense + {experts / 1e9:.2f}B of {m.num_experts // ep} experts "
           f"at EP {ep})") if m.num_experts else ""
    b.trainer.append(Row("policy weights", n * wb / GiB, f"{n / 1e9:.2f}B params/GPU{moe} in {m.dtype}"))
    zero = o.use_distributed_optimizer
    b.trainer.append(Row("gradients", n * 4 / GiB, "fp32 main grads" + (
        ", a flat buffer kept between steps" if zero else ", freed after each step"), resident=zero))
    opt_params = dense / (dp if dist_opt else 1) + experts / edp
    shard = (f", distributed over dp={dp}" + (f" (experts over expert-dp={edp})" if m.num_experts else "")
             if dist_opt else ", not sharded")
    b.trainer.append(Row("optimizer", opt_params * opt_bytes / GiB,
                         f"Adam m, v{' + fp32 master' if master else ''} ({opt_bytes} B/param)" + shard))
    ref_on = cfg.algorithm.kl_coef > 0
    offload = cfg.checkpoint.offload_reference
    b.trainer.append(Row("reference weights", n * wb / GiB if ref_on and not offload else 0.0,
                         "kl_coef=0: no reference" if not ref_on else
                         ("offloaded to CPU between uses" if offload else f"frozen copy in {m.dtype}")))
    # Transformer Engine caches each FP8 GEMM's weight (and its transpose for the backward)
    # on the module between steps; the reference, forward-only, only the weight.
    fp8 = (2 * n if m.fp8 != "none" else 0) + (n if m.reference_fp8 and ref_on and not offload else 0)
    b.trainer.append(Row("FP8 weight cache", fp8 / GiB, f"model.fp8={m.fp8}, reference_fp8={m.reference_fp8}"
                         + (": TE's FP8 weights + transposes, 2 B/param" if fp8 else "")))
    ours = zero and o.distributed_impl == "grpo"  # megatron's main grads are views of its buffer
    b.trainer.append(Row("step gradients", opt_params * 4 / GiB if ours else 0.0,
                         "the reduced fp32 slice (master.grad), from the reduce-scatter to the end of the step"
                         if ours else "none beyond the gradients row", resident=False))
    apply_lora(b.trainer, cfg, tp, pp, dp)  # frozen base: adapters' grads and state only, no reference

    hd = head_dim(m)
    inflight = min(pp, layout.micro_batches)
    tokens, how = micro_batch_tokens(cfg, layout)
    act = activation_bytes(m, tp, pp, inflight) * wb * tokens
    b.trainer.append(Row("activations", act / GiB, resident=False, note=
                         f"micro-batch {how} tokens{', packed' * p.packing} x {m.num_layers // pp} layers x "
                         f"{inflight} in flight, recompute {m.recompute}"
                         + (", sequence parallel" if m.sequence_parallel and tp > 1 else "")))
    vpad = padded_vocab(m.vocab_size, tp, m.make_vocab_size_divisible_by)
    logits = tokens * vpad / tp * (wb + 12)
    b.trainer.append(Row("logits", logits / GiB, f"last stage, vocab {vpad}/{tp}, fp32 log-softmax + grad",
                         resident=False))

    # Rollout engine: TP rollout.tp (as the trainer places it), replicas over the rest of the world.
    etp = rollout_tp(cfg)
    b.engine_tp = etp
    share = r.gpu_memory_utilization * gpu_gib
    separate = r.placement == "separate"  # the engines sit on their own GPUs, one per process
    replicas = r.engines if separate else max(layout.world // etp, 1)
    # vLLM's MoE layers shard the experts over all ranks of its DP x TP ("flatten TP across
    # DP", vllm FusedMoEParallelConfig): in external_launcher mode the engine replicas are
    # vLLM's DP ranks, so the experts are split over the whole world; other modes run one
    # engine per replica (DP 1) holding every expert on each of its TP shards.
    engine_dp = replicas if r.engine_mode in ("auto", "external_launcher") and not separate else 1
    ew = ((pc.total - pc.experts_total) / etp + pc.experts_total / (etp * engine_dp)) * wb / GiB
    kv = share - ew - ENGINE_OVERHEAD_GIB
    b.engine.append(Row("engine share", share, f"rollout.gpu_memory_utilization={r.gpu_memory_utilization}"))
    b.engine.append(Row("engine weights", ew, f"{m.dtype} at engine TP={etp}"
                        + (f", experts over TP x {engine_dp} engine replicas (vLLM's MoE TP spans its DP)"
                           if m.num_experts else "")))
    b.engine.append(Row("engine overhead", ENGINE_OVERHEAD_GIB, "activations, sampler, CUDA graphs "
                        f"(whose {CUDA_GRAPH_POOL_GIB:g} GiB pool stays while the engine sleeps)"))
    b.engine.append(Row("KV cache", max(kv, 0.0), "what remains of the share"))
    kv_per_token = 2 * m.num_layers * max(m.num_query_groups // etp, 1) * hd * wb
    b.kv_tokens = int(max(kv, 0.0) * GiB // kv_per_token)
    b.kv_seqs = b.kv_tokens // r.max_model_len
    b.seqs_per_engine = -(-layout.samples_per_step // replicas)

    # Forward-only log-probs: the logits, their fp32 upcast and log-softmax (no grad), and
    # an offloaded reference brought back for them.
    ref_extra = tokens * vpad / tp * (wb + 8) / GiB + (n * wb / GiB if ref_on and offload else 0.0)
    b.phases = phase_rows(b.trainer, placement=r.placement, sleeps=r.sleep_between_rollouts, share=share,
                          engine_weights=ew, reference_extra=ref_extra, sync_bucket=r.sync_bucket_mb / 1024,
                          save_gather=SAVE_GATHER_GIB if ours else 0.0, graph_pool=graph_pool_gib(r.enforce_eager))
    b.host_save_gib = b.row("optimizer") * dp if zero else 0.0
    return b


def report(cfg: Config, layout: Layout, budget: Budget, source: str = "") -> str:
    m, p, r = cfg.model, cfg.parallel, cfg.rollout
    pc = count_params(m, layout.tp, layout.pp, layout.ep)
    tp_in_node = layout.gpus_per_node % layout.tp == 0
    mode = {"auto": "auto (colocated on GPU)", "external_launcher": "external_launcher (colocated in every rank)"
            }.get(r.engine_mode, r.engine_mode)
    lines = [
        f"config: {source or '(defaults)'}",
        f"model: {m.family}, {pc.total / 1e9:.2f}B parameters, hidden {m.hidden_size}, "
        f"{m.num_layers} layers, {m.num_attention_heads} heads / {m.num_query_groups} kv heads, "
        f"ffn {m.ffn_hidden_size}, vocab {m.vocab_size} (padded {pc.embedding // m.hidden_size}), "
        f"{m.dtype}",
    ]
    if m.num_experts:
        lines.append(f"  experts: {m.num_experts} per layer, top-{m.moe_router_topk}, expert ffn "
                     f"{m.moe_ffn_hidden_size}; {pc.experts_total / 1e9:.2f}B in experts, "
                     f"{pc.active(m) / 1e9:.2f}B active per token")
    ep_note = (f" (ep {layout.ep} inside dp: expert-dp {layout.dp // layout.ep}; EP group "
               f"{'inside one node' if layout.gpus_per_node % (layout.tp * layout.ep) == 0 else 'spans nodes'})"
               if m.num_experts else "")
    lines += [
        f"layout: world {layout.world} = tp {layout.tp} x pp {layout.pp} x dp {layout.dp}{ep_note} "
        f"on {layout.nodes} node(s) x {layout.gpus_per_node} GPUs; "
        f"TP group {'inside one node' if tp_in_node else 'SPANS NODES (slow)'}",
        f"  per GPU: {m.num_layers // layout.pp} layers, {m.num_attention_heads // layout.tp} heads, "
        f"{max(m.num_query_groups // layout.tp, 1)} kv heads"
        + (f", {m.num_experts // layout.ep} experts" if m.num_experts else ""),
        f"batch: {cfg.data.prompts_per_step} prompts x n {r.n} = {layout.samples_per_step} samples/step; "
        f"mini-batch {layout.mini_batch} -> {layout.samples_per_step // layout.mini_batch} optimizer "
        f"step(s) x {cfg.algorithm.ppo_epochs} epoch(s); per DP rank {layout.micro_batches} "
        f"micro-batch(es) {micro_batch_tokens(cfg, layout)[1]} tokens{', packed' * p.packing}; "
        f"seq {layout.seq_len}; "
        f"pipeline bubble {layout.bubble:.1%}",
        (f"rollout engines: separate, {r.engines} process(es) on their own GPU(s) (the engine rows below are "
         f"each engine GPU's; the trainer's GPUs hold none), max_model_len {r.max_model_len}, "
         f"{budget.seqs_per_engine} sequences/step per engine" if r.placement == "separate" else
         f"rollout engine: {mode}, engine TP {budget.engine_tp} x {max(layout.world // budget.engine_tp, 1)} "
         f"replicas, max_model_len {r.max_model_len}, {budget.seqs_per_engine} sequences/step per replica"),
        "",
        f"memory per GPU (worst pipeline stage, GiB of {budget.gpu_gib:g}):",
    ]
    for row in budget.trainer + budget.engine:
        lines.append(f"  {row.name:<18} {row.gib:8.2f}  {row.note}")
    lines += [
        f"  KV cache holds {budget.kv_tokens:,} tokens = {budget.kv_seqs} sequences of "
        f"{r.max_model_len} per engine replica"
        + ("" if budget.kv_seqs >= budget.seqs_per_engine else
           f" (< {budget.seqs_per_engine} per step: vLLM runs them in waves)"),
        f"phases (GiB per GPU, each with a {RUNTIME_RESERVE_GIB:g} GiB reserve for the CUDA context, NCCL "
        f"and fragmentation):",
    ]
    lines += [f"  {ph.name + ' phase':<18} {ph.gib:8.2f}  {ph.note}" for ph in budget.phases]
    if budget.host_save_gib:
        lines.append(f"  host memory        {budget.host_save_gib:8.2f}  per rank while a save holds the "
                     f"optimizer's whole state")
    lines.append(f"  peak {budget.peak_gib:.2f} GiB ({budget.peak_phase}), headroom {budget.headroom_gib:.2f} GiB: "
                 + ("fits" if budget.fits else "DOES NOT FIT"))
    return "\n".join(lines)


def budget_paragraph(cfg: Config, layout: Layout, b: Budget) -> str:
    """The budget as one prose paragraph (written into the scale configs' comment block)."""
    m, p, r = cfg.model, cfg.parallel, cfg.rollout
    n = count_params(m, layout.tp, layout.pp, layout.ep).worst_stage
    g = {x.name: x.gib for x in b.trainer + b.engine}
    shard = (f"sharded over dp {layout.dp}" if cfg.optimizer.use_distributed_optimizer and layout.dp > 1
             else "not sharded")
    if m.num_experts:
        n_note = (f"{n / 1e9:.2f}B parameters ({m.num_experts // layout.ep} of {m.num_experts} experts "
                  f"per GPU at EP {layout.ep})")
    else:
        n_note = f"{n / 1e9:.2f}B parameters"
    recompute = "no recompute" if m.recompute == "none" else f"recompute {m.recompute}"
    return (
        f"Memory per GPU (worst pipeline stage, {b.gpu_gib:g} GiB card, estimate): {n_note} "
        f"give {m.dtype} weights {g['policy weights']:.2f} GiB, fp32 gradients "
        f"{g['gradients']:.2f}, Adam states with fp32 master {g['optimizer']:.2f} ({shard}), "
        f"reference copy {g['reference weights']:.2f}; training adds activations "
        f"{g['activations']:.2f} (micro-batch {micro_batch_tokens(cfg, layout)[1]} tokens x "
        f"{m.num_layers // layout.pp} layers x {min(layout.pp, layout.micro_batches)} in flight, "
        f"{recompute}) and logits {g['logits']:.2f}. The colocated vLLM engine gets "
        f"{g['engine share']:.2f} GiB ({r.gpu_memory_utilization:g} of the GPU): weights "
        f"{g['engine weights']:.2f} at TP {b.engine_tp}, overhead {g['engine overhead']:.2f}, KV cache "
        f"{g['KV cache']:.2f} = {b.kv_tokens:,} tokens = {b.kv_seqs} sequences of {r.max_model_len} per "
        f"replica ({b.seqs_per_engine} needed per step). A checkpoint save, the engine released and the "
        f"optimizer state gathered to host memory, takes {b.phase('save'):.2f} GiB. "
        f"Peak {b.peak_gib:.2f} GiB in the {b.peak_phase} "
        f"phase (including a {RUNTIME_RESERVE_GIB:g} GiB runtime reserve), "
        f"{b.headroom_gib:.2f} GiB headroom.")


BEGIN, END = "# @budget-begin", "# @budget-end"


def budget_block(cfg: Config, layout: Layout, b: Budget, source: str) -> str:
    """Comment block for a YAML config: the paragraph, then the full report."""
    import textwrap
    para = textwrap.wrap(budget_paragraph(cfg, layout, b), 88)
    body = para + [""] + report(cfg, layout, b, source).splitlines()
    head = f"{BEGIN} (generated by `python -m grpo_mega.preflight.budget --write-budget`; tests check it)"
    return "\n".join([head] + [("# " + line).rstrip() for line in body] + [END])


def write_budget(path: str, block: str) -> None:
    """Replace the text between the budget markers of ``path`` with ``block``."""
    text = open(path).read()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < 0:
        raise ConfigError(f"{path} has no '{BEGIN}' ... '{END}' markers to write the budget into")
    with open(path, "w") as f:
        f.write(text[:i] + block + text[j + len(END):])


def _pop_option(argv: list[str], name: str) -> Optional[str]:
    for i, a in enumerate(argv):
        if a == name:
            if i + 1 >= len(argv):
                raise ConfigError(f"{name} needs a value")
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
        if a.startswith(name + "="):
            del argv[i]
            return a.split("=", 1)[1]
    return None


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    try:
        validate_only = "--validate-only" in argv
        write = "--write-budget" in argv
        require_paths = "--require-paths" in argv
        argv = [a for a in argv if a not in ("--validate-only", "--write-budget", "--require-paths")]
        path = _pop_option(argv, "--config")
        world = _pop_option(argv, "--world-size")
        gpn = int(_pop_option(argv, "--gpus-per-node") or 8)
        gpu_gib = float(_pop_option(argv, "--gpu-memory-gib") or GPU_GIB)
        cfg = load_config(path, argv)
        shape_src = (model_shape_from_hf(cfg) if cfg.model.hf_checkpoint
                     else "the config (model.hf_checkpoint not given)")
        p = cfg.parallel
        world = int(world) if world else p.tp * p.pp * max(p.dp, 1)
        validate(cfg, None, check_hardware=False)  # what no world size could run
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        validate(cfg, world, check_hardware=False)
    except ConfigError as e:
        print(f"layout error: {e}", file=sys.stderr)
        return 2
    try:
        check_paths(cfg, require=require_paths)  # after the layout, in the trainer's order
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    layout = derive_layout(cfg, world, gpn)
    if validate_only:
        print(f"shape validated: {describe_shape(cfg)}, from {shape_src}")
        print(f"ok: world {world} = tp {layout.tp} x pp {layout.pp} x dp {layout.dp}")
        return 0
    budget = memory_budget(cfg, layout, gpu_gib)
    if write:
        if not path or argv:
            print("config error: --write-budget needs --config FILE and no overrides", file=sys.stderr)
            return 2
        write_budget(path, budget_block(cfg, layout, budget, path))
    print(f"shape validated: {describe_shape(cfg)}, from {shape_src}")
    print(report(cfg, layout, budget, path or ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
