"""Names of TE's operation-based API that megatron's class bodies refer to (never built)."""


class FusibleOperation:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("transformer_engine stub: te.pytorch.ops are not implemented")


class Sequential(FusibleOperation):
    pass


SwiGLU = GEGLU = ReGLU = GELU = ReLU = SiLU = LayerNorm = RMSNorm = BasicLinear = Bias = Sequential
AllReduce = ReduceScatter = AllGather = Sequential
