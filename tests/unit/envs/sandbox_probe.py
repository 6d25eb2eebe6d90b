"""Whether this machine can build the tool sandbox, probed once for the sandbox tests."""
import pytest

from grpo_mega.envs.sandbox import Sandbox, SandboxUnavailable

try:
    Sandbox().check()
    UNAVAILABLE = None
except SandboxUnavailable as e:  # e.g. a kernel without unprivileged user namespaces
    UNAVAILABLE = str(e)
needs_sandbox = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no tool sandbox here: {UNAVAILABLE}")
