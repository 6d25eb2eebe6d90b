"""FP8 state as megatron queries it: never enabled in the stub."""
from contextlib import nullcontext


class FP8GlobalStateManager:
    @staticmethod
    def is_fp8_enabled() -> bool:
        return False


def fp8_autocast(*args, **kwargs):
    return nullcontext()
