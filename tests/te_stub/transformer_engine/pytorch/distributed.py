"""The RNG tracker base class megatron subclasses at import time."""


class CudaRNGStatesTracker:
    def __init__(self):
        self.states_ = {}

    def reset(self):
        self.states_ = {}

    def set_states(self, states):
        self.states_ = states

    def add(self, name, seed):
        self.states_[name] = seed


def activation_recompute_forward(*args, **kwargs):
    raise NotImplementedError("transformer_engine stub: no activation recompute")


def checkpoint(*args, **kwargs):
    raise NotImplementedError("transformer_engine stub: no activation checkpointing")
