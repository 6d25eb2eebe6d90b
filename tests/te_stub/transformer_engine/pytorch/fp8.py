"""FP8 state as megatron queries it: never enabled in the stub."""
from contextlib import nullcontext


class FP8GlobalStateManager:
    @staticmethod
    def is_fp8_enabled() -> bool:
        return False


def fp8_autocast(*args, **kwargs):
    return nullcontext()


def fp8_model_init(enabled: bool = False, recipe=None, preserve_high_precision_init_val: bool = False):
    """megatron-core 0.19 enters this around every TE layer's construction (FP8 weights off here)."""
    return nullcontext()
