"""A script that submits a run on the local executor and waits for it ends clean: no "Exception ignored in
LocalJob.__del__" traceback at interpreter exit (submitit's destructor tidies its process table with helpers
that are already torn down then; moelab.launch.detached.DetachedLocalJob skips that while the interpreter
finalizes)."""
import subprocess
import sys

from support import SMALL_CLI

SCRIPT = """
import sys
from moelab import Session
overrides = dict(a.split("=", 1) for a in sys.argv[2:] if a != "--set")
s = Session("tiny", train={"steps": 2}).set(overrides)
run = s.submit("local", folder=sys.argv[1])
run.wait()
print("status", run.status)
"""


def test_a_local_submit_script_exits_without_a_destructor_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run"), *SMALL_CLI], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "status COMPLETED" in r.stdout, r.stdout + r.stderr
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr
