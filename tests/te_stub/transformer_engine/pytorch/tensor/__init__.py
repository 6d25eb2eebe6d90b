"""TE 2.x's quantized-tensor base class, which megatron uses in isinstance checks only."""
import torch


class QuantizedTensor(torch.Tensor):
    pass
