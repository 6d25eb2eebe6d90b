"""Make megatron-core 0.19.2 run on a CPU-only torch. Applied only when CUDA is absent.

megatron-core assumes CUDA in a handful of places that a CPU run reaches. Each
patch below names the place; none changes numerics. On a machine with CUDA
``apply()`` does nothing, so GPU runs use megatron unmodified.

    from grpo_mega.distributed import cpu_compat
    cpu_compat.apply()          # idempotent; call before building models
"""
from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)
_APPLIED = False
_MEGATRON_OPTIMIZER = False
CPU = torch.device("cpu")


def needed() -> bool:
    return not torch.cuda.is_available()


class CpuRNGStatesTracker:
    """Named RNG streams on the CPU generator (megatron's tracker forks CUDA states).

    TP ranks get different model-parallel streams, as on GPU, so dropout inside
    TP regions stays decorrelated across shards.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_, self.seeds_ = {}, set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        if seed in self.seeds_ or name in self.states_:
            raise RuntimeError(f"RNG stream {name!r} / seed {seed} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"RNG stream {name!r} was never added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _cpu_model_parallel_seed(seed, *args, tp_rank=None, **kwargs):
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import random as mrandom

    if tp_rank is None:
        tp_rank = mpu.get_tensor_model_parallel_rank()
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if not isinstance(tracker, CpuRNGStatesTracker):
        tracker = CpuRNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER = tracker
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tracker.reset()
    torch.manual_seed(seed)
    # Same offsets as megatron: data-parallel stream = seed, TP stream = seed + 2718 + tp_rank.
    tracker.add("data-parallel-rng", seed)
    tracker.add("model-parallel-rng", seed + 2718 + tp_rank)
    tracker.add("expert-parallel-rng", seed + 1024)


class _CpuTorch:
    """Stands in for ``torch`` inside a megatron module that allocates with device="cuda"."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name in ("zeros", "ones", "empty", "tensor", "full", "arange"):
            def on_cpu(*a, **kw):
                if str(kw.get("device", "")).startswith("cuda"):
                    kw["device"] = CPU
                return attr(*a, **kw)
            return on_cpu
        return attr


def _patch_moe() -> None:
    """Two places in megatron's MoE layer:

    * the alltoall token dispatcher copies its split sizes device-to-host on a side CUDA
      stream (created in __init__) and waits on a CUDA event. On CPU the tensors are already
      on the host: turn the splits into numpy arrays, as the CUDA path does, with no streams;
    * the router's gating GEMM tests ``te_general_gemm is not None``, a name only bound when
      Transformer Engine imports; bind it to None so the torch.mm path runs."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import token_dispatcher as td

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def host_splits(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for attr in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, attr, None)
                if torch.is_tensor(value):
                    setattr(self, attr, value.numpy())
        return tokens_per_expert

    td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu"  # non-None: __init__ makes no stream
    td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = host_splits


def _default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply() -> bool:
    """Install the patches if CUDA is absent. Returns True when they are active."""
    global _APPLIED
    if _APPLIED:
        return True
    if not needed():
        return False
    # Layers pass device=torch.cuda.current_device() to allocations.
    torch.cuda.current_device = lambda: CPU
    torch.cuda.synchronize = lambda *a, **k: None
    # LanguageModule.setup_embeddings_and_output_layer moves the tied weight with .cuda()
    # before the embedding-group all-reduce (PP with tied embeddings).
    torch.Tensor.cuda = lambda self, *a, **k: self

    from megatron.core.tensor_parallel import random as mrandom
    import megatron.core.tensor_parallel as mtp
    mrandom.model_parallel_cuda_manual_seed = _cpu_model_parallel_seed
    mtp.model_parallel_cuda_manual_seed = _cpu_model_parallel_seed
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recomputation (CheckpointFunction) saves and restores the CUDA generator
    # next to the CPU one; here the CPU generator is the only one, restored with it.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None

    # The schedules allocate their token counter with device="cuda".
    from megatron.core.pipeline_parallel import schedules
    schedules.torch = _CpuTorch(torch)

    # attention_mask=None builds the default causal mask on "cuda".
    from megatron.core.transformer import utils as tutils
    tutils.get_default_causal_mask = _default_causal_mask
    try:
        from megatron.core.fusions import fused_softmax
        fused_softmax.get_default_causal_mask = _default_causal_mask
    except ImportError:
        pass
    _patch_moe()
    _APPLIED = True
    log.info("cpu_compat: megatron-core patched for a CPU-only torch")
    return True


def megatron_optimizer_on_cpu() -> bool:
    """True once ``enable_megatron_optimizer`` ran (tests only)."""
    return _MEGATRON_OPTIMIZER


class _CudaNamesOnCpu(torch.overrides.TorchFunctionMode):
    """megatron's optimizer code names CUDA outright: ``device='cuda'`` allocations
    (optimizer.py, clip_grads.py), ``.cuda()`` copies (distrib_optimizer.py's state gather)
    and ``param.type() == 'torch.cuda.FloatTensor'`` checks (which sort parameters into
    fp32 / bf16 groups). Here those allocate on the CPU, ``.cuda()`` keeps the tensor, and a
    CPU tensor's ``type()`` answers with its CUDA name. Nothing changes numerically."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        dev = kwargs.get("device")
        if dev is not None and not isinstance(dev, int) and torch.device(dev).type == "cuda":
            kwargs = {**kwargs, "device": CPU}
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str) \
                and not out.startswith("torch.cuda."):
            return "torch.cuda." + out[len("torch."):]
        return out


class _HostStream:
    """What ``torch.cuda.current_stream()`` returns under ``enable_megatron_optimizer``:
    megatron-core 0.19's grad sync (``param_and_grad_buffer.start_grad_sync``) asks for the
    current stream on every call to wait on CUDA-graph events, which a CPU run never records;
    on the host there is nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def enable_megatron_optimizer() -> None:
    """Let megatron's DDP + DistributedOptimizer (``optimizer.distributed_impl=megatron``) run
    on CPU, for tests that compare it with the project's optimizers over gloo: for the rest of
    this process CUDA-named allocations land on the CPU (``_CudaNamesOnCpu``). Not used by
    training, where preflight refuses that setting without CUDA. Megatron also needs its gloo
    DP groups (``initialize_model_parallel(create_gloo_process_groups=True)``)."""
    global _MEGATRON_OPTIMIZER
    if not needed() or _MEGATRON_OPTIMIZER:
        return
    apply()
    torch.cuda.current_stream = lambda device=None: _HostStream()
    _CudaNamesOnCpu().__enter__()  # stays on: this process now stands in for a GPU job
    _MEGATRON_OPTIMIZER = True
