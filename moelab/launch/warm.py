"""A warm rank process per host: a process that has already imported torch, torch._dynamo (every torch
optimizer loads it) and moelab's trainer, and forks a rank for each task the local executor starts. A rank's
start then costs a fork (milliseconds) instead of the imports (2 s on an idle 2-core machine, 10 s and more on a
busy one).

    warm.start()                       # Session.submit("local") does this; a no-op when one is up or starting
    python .../moelab/launch/warm.py run -- python -u -m submitit.core._submit FOLDER    # what a task runs

How a task gets its rank: submitit's local controller starts the task command, which here is this file run by path
(the client: standard library only, no package import, about 30 ms). The client hands the server its command line,
environment, working folder and its stdin/stdout/stderr (SCM_RIGHTS), and the server forks a worker that takes
them over and runs the command's module as `python -m` would. The client stays as the task's stand-in: it passes
on every signal the controller sends (SIGTERM, SIGINT, SIGUSR1/2 ...) to the worker and exits with the worker's
exit code; if the client dies, the worker gets SIGTERM (it checkpoints at the step boundary and stops, as a rank
whose launcher died does: moelab.launch.local.die_with_parent). Without a server (MOELAB_WARM=0, none started
yet, a different environment) the client runs the command as its own child: a cold start. A rank killed by a
signal (SIGKILL leaves no traceback) is reported by its stand-in on the task's stderr (KILLED: the server reaps
its workers and tells the client how each ended), and the stand-in ends by the same signal.

One server per (python, PYTHONPATH, moelab's source files, the environment torch reads at import): editing
moelab's code, or running another checkout, gets a server of its own; an idle server exits after
MOELAB_WARM_IDLE_S seconds (default 600). The server never initialises CUDA and runs no torch op, so a fork
inherits no threads and no device state; a worker sets torch's thread count from the task's OMP_NUM_THREADS.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

# (what a task runs as __main__, submitit.core._submit, is not among them: `python -m` executes a module afresh, and
# runpy warns "found in sys.modules ... prior to execution" into every rank log when it was imported already)
MODULES = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "submitit",
           "submitit.core.submission", "moelab.launch.entry", "moelab.launch.executors", "moelab.train.trainer")
# what the process reads at start or at import, so a rank forked from a server started under other values would
# differ from a cold one (thread counts are set per rank instead; the wait policy is defaulted as the ranks do)
IMPORT_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "ATEN_", "PYTORCH_", "TORCH_", "PYTHONHASHSEED", "PYTHONPATH",
              "LD_PRELOAD", "LD_LIBRARY_PATH")
PER_RANK_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
WAIT_FOR_START_S = 30.0
PACKAGE = Path(__file__).resolve().parents[1]


def enabled(env=os.environ) -> bool:
    return env.get("MOELAB_WARM", "1") != "0"


def _import_env(env) -> dict:
    out = {k: v for k, v in env.items() if k.startswith(IMPORT_ENV) and k not in PER_RANK_ENV}
    out.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # moelab.launch.entry.quiet_idle_threads
    return out


def key(env=os.environ) -> str:
    """Who may serve whom: the interpreter, the environment read at import, and moelab's source files."""
    h = hashlib.sha256(json.dumps([sys.executable, sorted(_import_env(env).items())]).encode())
    for path in sorted(PACKAGE.rglob("*.py")):
        st = path.stat()
        h.update(f"{path.relative_to(PACKAGE)}:{st.st_mtime_ns}:{st.st_size}\n".encode())
    return h.hexdigest()[:16]


def home() -> Path:
    d = Path(tempfile.gettempdir()) / f"moelab-warm-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def _alive(pid_file: Path) -> int:
    """The pid in `pid_file` when that process lives, else 0."""
    try:
        pid = int(pid_file.read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return 0


def _lives(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _being_written(pid_file: Path) -> bool:
    """Another starter holds the pid file and has not written the pid yet (its middle process takes ~0.1 s)."""
    try:
        return pid_file.stat().st_size == 0 and time.time() - pid_file.stat().st_mtime < 10
    except OSError:
        return False


def start(env=None) -> bool:
    """Start this environment's server in the background unless it is up or starting; True when one is (or will
    be) there. Returns at once: the server imports for a few seconds before it listens."""
    env = dict(os.environ if env is None else env)
    if not enabled(env):
        return False
    import subprocess

    k = key(env)
    pid_file = home() / f"{k}.pid"
    if _alive(pid_file):
        return True
    try:  # one starter wins; a stale pid file (its server died) is replaced
        fd = os.open(pid_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        if _alive(pid_file) or _being_written(pid_file):
            return True
        pid_file.unlink(missing_ok=True)
        return start(env)
    for name in PER_RANK_ENV:
        env.pop(name, None)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # started through a short-lived middle process, so that the server is nobody's child: a run's launcher
    # (`moelab run`, a kernel) owns its ranks, never the host's warm process
    log = home() / f"{k}.log"
    middle = ("import subprocess, sys; log = open(sys.argv[1], 'ab'); print(subprocess.Popen(sys.argv[2:], "
              "stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True).pid)")
    out = subprocess.run([sys.executable, "-c", middle, str(log), sys.executable, "-m", "moelab.launch.warm",
                          "serve", k], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    os.write(fd, out.stdout.strip().encode() if out.returncode == 0 else b"0")
    os.close(fd)
    return out.returncode == 0


def stop(env=None) -> None:
    """Stop this environment's server, if any (tests; a changed install)."""
    pid = _alive(home() / f"{key(os.environ if env is None else env)}.pid")
    if pid:
        os.kill(pid, signal.SIGTERM)


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `signum` to this process when its parent dies (Linux PR_SET_PDEATHSIG), so a rank
    never outlives its launcher: SIGTERM makes it checkpoint at the step boundary and end PREEMPTED. A no-op
    where prctl is missing. Call it first thing in the child (or as Popen's preexec_fn)."""
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signum), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signum)


# ---- the server -------------------------------------------------------------------------------------------

def serve(k: str) -> None:
    import importlib

    t0 = time.perf_counter()
    for name in MODULES:
        importlib.import_module(name)
    preload_s = time.perf_counter() - t0
    d = home()
    sock_path, pid_file = d / f"{k}.sock", d / f"{k}.pid"
    tmp = d / f"{k}.{os.getpid()}.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(tmp))
    srv.listen(64)
    os.replace(tmp, sock_path)  # clients see a listening socket or none
    conns: dict[int, socket.socket] = {}  # worker pid -> the server's end of its client's connection
    ended: dict[int, int] = {}  # reaped before its connection was recorded (a worker that died at once)

    def reap(*_) -> None:  # SIGCHLD: how each worker ended goes to its client (a SIGKILL leaves no EXIT line)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.waitstatus_to_exitcode(status)
            conn = conns.pop(pid, None)
            if conn is None:
                ended[pid] = code
                continue
            _tell_ended(conn, code)

    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    idle_s = float(os.environ.get("MOELAB_WARM_IDLE_S", "600"))
    print(f"warm server {k}: pid {os.getpid()}, imports {preload_s:.2f} s, idle exit after {idle_s:.0f} s",
          flush=True)
    workers: set[int] = set()
    try:
        srv.settimeout(idle_s)
        while True:
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                workers = {pid for pid in workers if _lives(pid)}
                if workers:  # a rank's parent is this server: it stays while any trains
                    continue
                break
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError) as e:
                print(f"warm server {k}: a bad request ({e})", flush=True)
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                srv.close()
                for other in conns.values():  # other ranks' connections: theirs to close
                    other.close()
                _worker(conn, request, fds, preload_s)  # never returns
            workers.add(pid)
            if pid in ended:
                _tell_ended(conn, ended.pop(pid))
            else:
                conns[pid] = conn
            for fd in fds:
                os.close(fd)
    finally:
        if _alive(pid_file) == os.getpid():
            sock_path.unlink(missing_ok=True)
            pid_file.unlink(missing_ok=True)


def _tell_ended(conn: socket.socket, code: int) -> None:
    """Tell a worker's client how the worker ended (ENDED <exit code, or -signal>), then close our end."""
    try:
        conn.sendall(f"ENDED {code}\n".encode())
    except OSError:
        pass
    conn.close()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds: list[int] = []
    data = b""
    while not data.endswith(b"\n"):
        msg, anc, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * 4))
        if not msg:
            raise ValueError("the client left before its request was complete")
        data += msg
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(memoryview(payload).cast("i"))
    if len(fds) != 3:
        raise ValueError(f"expected stdin, stdout and stderr, got {len(fds)} descriptors")
    return json.loads(data), fds


def _worker(conn: socket.socket, request: dict, fds: list[int], preload_s: float) -> None:
    """The forked rank: become the task the client stands for, run its module, report its exit code."""
    import atexit
    import io
    import runpy
    import threading
    import traceback

    code = 1
    try:
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        os.setpgid(0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["MOELAB_WARM_CHILD"] = "1"  # moelab.launch.entry.WARM_CHILD: this server ends the process
        print(f"moelab.launch.warm: this rank was forked from the warm process {os.getppid()} (its imports, "
              f"{preload_s:.1f} s, were done before the submit)", file=sys.stderr)
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        conn.sendall(f"PID {os.getpid()}\n".encode())

        ended = threading.Event()  # the module has returned: the client closing now is its normal exit

        def client_gone():  # the client's end closes: its process died (SIGKILL) or it was told to stop
            try:
                while conn.recv(64):
                    pass
            except OSError:
                pass
            if not ended.is_set():  # else a SIGTERM reached the rank's handlers (submitit: "Bypassing signal")
                os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=client_gone, daemon=True).start()
        module, args = request["module"], request["args"]
        sys.argv = [module, *args]
        sys.modules.pop(module, None)  # run as __main__ afresh, as `python -m` does (no runpy RuntimeWarning)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        ended.set()
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            conn.sendall(f"EXIT {code}\n".encode())
        except (OSError, ValueError):
            pass
        os._exit(code)


# ---- the client (standard library only: this file runs by path) ---------------------------------------------

def _module_command(command: list[str]) -> tuple[str, list[str]] | None:
    """(module, args) of `python [-u] -m MODULE ARGS...`, the only form a server runs; None for any other."""
    i = 1
    while i < len(command) and command[i] in ("-u", "-B"):
        i += 1
    if i + 1 < len(command) and command[i] == "-m":
        return command[i + 1], command[i + 2:]
    return None


def _connect(k: str) -> socket.socket | None:
    d = home()
    sock_path, pid_file = d / f"{k}.sock", d / f"{k}.pid"
    deadline = time.monotonic() + WAIT_FOR_START_S
    while True:
        if sock_path.exists():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(sock_path))
                return s
            except OSError:
                s.close()
        if not _alive(pid_file) or time.monotonic() > deadline:  # none starting: go cold
            return None
        time.sleep(0.05)


def run(command: list[str]) -> None:
    """The task's stand-in: have the server fork the rank, relay signals to it, exit with its code; without a
    server, exec `command` (a cold start)."""
    die_with_parent()  # the controller killed: pass SIGTERM on, as a cold task would get it
    parsed = _module_command(command)
    conn = _connect(key()) if enabled() and parsed else None
    if conn is None:
        _cold(command)
    module, args = parsed
    request = {"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}
    import array

    conn.sendmsg([json.dumps(request).encode() + b"\n"],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    reader = conn.makefile("r")
    first = reader.readline()
    if not first.startswith("PID "):
        _cold(command)  # the server could not fork: go cold
    pid = int(first.split()[1])
    _relay_signals(pid)
    line = reader.readline()  # signals above interrupt it and it resumes (PEP 475)
    _end_as(pid, int(line.split()[1]) if line.startswith(("EXIT ", "ENDED ")) else 1)


def _relay_signals(pid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCONT,
                signal.SIGQUIT):
        signal.signal(sig, lambda signum, frame: _forward(pid, signum))


KILLED = "moelab.launch.warm: rank process {pid} was killed by signal {signum} ({name})"  # Run.error finds it


def _end_as(pid: int, code: int) -> None:
    """End the stand-in as the rank ended: its exit code, or, for a rank killed by a signal, a line saying so
    on the task's stderr (the rank's log: no traceback can tell it) and the same signal."""
    if code >= 0:
        sys.exit(code)
    name = signal.Signals(-code).name if -code in signal.valid_signals() else "?"
    print(KILLED.format(pid=pid, signum=-code, name=name), file=sys.stderr, flush=True)
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    sys.exit(128 - code)


def _cold(command: list[str]) -> None:
    """Without a server: run `command` as a child (a rank that dies with its stand-in) and end as it ended."""
    pid = os.fork()
    if pid == 0:
        try:
            die_with_parent()
            os.execvp(command[0], command)
        finally:
            os._exit(127)
    _relay_signals(pid)
    _, status = os.waitpid(pid, 0)
    _end_as(pid, -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.waitstatus_to_exitcode(status))


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def client_command(command: str) -> str:
    """The task command for submitit's local controller: this client in front of submitit's `command`."""
    import shlex

    return " ".join([shlex.quote(sys.executable), shlex.quote(str(Path(__file__).resolve())), "run", "--", command])


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    elif sys.argv[1:3] == ["run", "--"]:
        run(sys.argv[3:])
    else:
        sys.exit("usage: warm.py serve KEY | warm.py run -- COMMAND...")
