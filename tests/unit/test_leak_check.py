"""The session-wide leak check of tests/conftest.py fails a run that leaves something behind."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests import REPO


def test_kill_leak_check_fails_a_session_that_leaves_a_process_or_shm_segment(tmp_path):
    """Guards against an orphaned process (a rank or worker outliving its test, as a
    ``launch_collective.py`` rank did for 25 minutes) and a leaked shm segment going
    unnoticed: an inner pytest session whose test starts a detached ``sleep`` and writes a
    vLLM-named segment must fail, name both, and leave neither behind; a clean inner
    session must pass."""
    seg = f"-tp:9-[0-1]-cpushm_{os.getpid()}"  # after the inner session's own prefix
    (tmp_path / "test_leaky.py").write_text(textwrap.dedent(f"""
        import subprocess
        def test_leaks():
            p = subprocess.Popen(["sleep", "300"], start_new_session=True)
            open("{tmp_path}/pid", "w").write(str(p.pid))
            import os
            name = "grpo-" + os.environ["GRPO_MEGA_SHM_TAG"] + "{seg}"
            open("/dev/shm/" + name, "wb").write(b"x")
            open("{tmp_path}/seg", "w").write(name)
        def test_clean():
            pass
    """))
    env = dict(os.environ, PYTHONPATH=str(REPO), GRPO_MEGA_LEAK_GRACE_S="1")
    env.pop("GRPO_MEGA_LEAK_CHECK", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "--rootdir", str(tmp_path),
           str(tmp_path / "test_leaky.py")]
    leaky = subprocess.run(cmd + ["-k", "leaks"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    out = leaky.stdout + leaky.stderr
    assert leaky.returncode == 1 and "1 passed" in out, out
    assert "[leak check]   process pid" in out and "sleep 300" in out, out
    name = (tmp_path / "seg").read_text()
    assert f"[leak check]   /dev/shm/{name}" in out, out
    assert not os.path.exists(f"/dev/shm/{name}")
    import psutil
    pid = int((tmp_path / "pid").read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    clean = subprocess.run(cmd + ["-k", "clean"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    assert clean.returncode == 0, clean.stdout + clean.stderr
