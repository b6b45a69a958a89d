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


END = """
import atexit, sys
from moelab.launch.entry import end_process
atexit.register(lambda: open(sys.argv[1], "w").write("ran"))
sys.stdout.write("no newline yet")
end_process(3)
"""


def test_a_rank_process_ends_with_its_exit_handlers_run_and_its_output_flushed(tmp_path):
    """moelab.launch.entry.end_process skips the interpreter's teardown (where torch's leftover gloo threads made
    finished ranks abort) but not what a normal exit does first."""
    mark = tmp_path / "mark"
    r = subprocess.run([sys.executable, "-c", END, str(mark)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert r.stdout == "no newline yet" and mark.read_text() == "ran"


def test_a_failing_rank_exits_1_with_its_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "moelab.launch.entry", str(tmp_path / "no-such-run")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "config.yaml" in r.stderr, r.stderr
