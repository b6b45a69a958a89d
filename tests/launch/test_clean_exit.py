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


LATE_WORKER = """
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    time.sleep(2.0)  # rank 1 is at its end long before this collective completes
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError:
        pass  # rank 1 already gone
else:
    work = dist.all_reduce(torch.ones(4), async_op=True)
    work.get_future().then(lambda fut: None)  # gloo's worker takes the GIL for this when the collective ends
    if sys.argv[1] == "end_process":
        from moelab.launch.entry import end_process
        end_process(0)
"""


def test_a_rank_whose_gloo_worker_still_needs_the_gil_ends_by_end_process_and_aborts_in_teardown(tmp_path):
    """The teardown abort that end_process avoids, made certain: rank 1 reaches its end while gloo's worker has
    Python to run once its collective completes (in real ranks: freeing the collective's tensors, late on a busy
    machine). Through the interpreter's teardown the worker is ended mid-unwind and the rank aborts ("terminate
    called without an active exception"); ended by end_process, the rank exits with its own code."""
    from moelab.launch.local import free_port, rank_env

    script = tmp_path / "late_worker.py"
    script.write_text(LATE_WORKER)
    runs = {}
    for mode in ("end_process", "teardown"):
        port = free_port()
        runs[mode] = [subprocess.Popen([sys.executable, str(script), mode], env=rank_env(r, 2, port),
                                       stderr=subprocess.PIPE, text=True) for r in range(2)]
    rank1 = {mode: (procs[1].wait(timeout=120), procs[1].stderr.read()) for mode, procs in runs.items()}
    for procs in runs.values():
        procs[0].communicate(timeout=120)
    assert rank1["end_process"][0] == 0, rank1["end_process"][1]
    # the control: if the interpreter's teardown no longer aborts here, torch or CPython changed (see end_process)
    assert rank1["teardown"][0] != 0 and "terminate called without an active exception" in rank1["teardown"][1], \
        rank1["teardown"]


def test_end_at_exit_runs_the_other_exit_handlers_and_ends_with_its_code(tmp_path):
    # a process that returns normally after end_at_exit(3): the handler registered before it still runs (its file
    # is written), the output is flushed, and the exit code is end_at_exit's (os._exit: no finalisation)
    import subprocess
    import sys

    mark = tmp_path / "ran"
    code = ("import atexit, pathlib; from moelab.launch.entry import end_at_exit; "
            f"atexit.register(lambda: pathlib.Path({str(mark)!r}).write_text('x')); end_at_exit(3); print('done')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3 and out.stdout.strip() == "done" and mark.read_text() == "x"
