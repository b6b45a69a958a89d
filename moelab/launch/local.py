"""N rank processes on this machine in the foreground, started the way torchrun starts them (the gallery's
multi-GPU benchmarks and the multi-process tests use it; runs of users go through Session and an executor).

    summary = run_local_processes(load_config("tiny", ["parallel.ep=2"]), "runs/ep2", nproc=2)

Each rank is ``python -m moelab.launch.entry RUN_DIR`` with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port), so the same entry point runs under
torchrun, srun or submitit unchanged. Rank r's output goes to RUN_DIR/logs/rank{r}.out and .err.

Failure: when a rank exits with an error, the others get `grace_s` seconds to notice on their own (a collective
with a dead peer raises, and a hung one times out after train.collective_timeout_s), then are terminated; the
launcher raises ``RankFailed`` with the first failing rank's traceback (from its `error` event in
metrics.jsonl, else the tail of its stderr) and where its logs are.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from moelab.config import Config, save_config
from moelab.contract.folder import RunFolder, lock_folder
from moelab.contract.events import ErrorEvent
from moelab.contract.stream import MetricsError, read_events
from moelab.launch.warm import die_with_parent
from moelab.layout.dims import ParallelDims


class RankFailed(RuntimeError):
    """A rank of a local multi-process run failed; the message carries its traceback and log paths.

        try: run_local_processes(cfg, "runs/x", 2)
        except RankFailed as e: e.rank, e.returncode
    """

    def __init__(self, message: str, rank: int, returncode: int):
        super().__init__(message)
        self.rank, self.returncode = rank, returncode


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int, extra: dict | None = None) -> dict:
    """torchrun's environment for `rank` of `nproc` local processes (CPU threads split between them)."""
    env = {**os.environ, **(extra or {})}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))  # as torchrun does
    return env


def launch(argv: list[str], nproc: int, log_dir: "str | Path", env: dict | None = None, grace_s: float = 10.0,
           metrics_path: "str | Path | None" = None) -> None:
    """Run `argv` as ranks 0..nproc-1 and wait for all of them; raise RankFailed if any fails."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, files = [], []
    forward = _forward_signals(procs)  # SIGTERM / SIGINT to the launcher reach every rank
    try:
        for r in range(nproc):
            out, err = open(log_dir / f"rank{r}.out", "w"), open(log_dir / f"rank{r}.err", "w")
            files += [out, err]
            procs.append(subprocess.Popen(argv, env=rank_env(r, nproc, port, env), stdout=out, stderr=err,
                                          preexec_fn=die_with_parent))
        ended = _end_times(procs)
        failed, failed_at = None, None
        while True:
            done = dict(ended)  # rank: when it ended
            bad = {r: t for r, t in done.items() if procs[r].returncode != 0}
            if bad:  # the rank that failed first (a dead rank's peers fail within milliseconds, on their own)
                failed = min(bad, key=bad.get)
                failed_at = time.monotonic() if failed_at is None else failed_at
            if len(done) == nproc:
                break
            if failed is not None and time.monotonic() - failed_at > grace_s:
                break
            time.sleep(0.05)
    finally:
        forward.restore()
        _stop(procs)
        for f in files:
            f.close()
    if failed is not None:
        raise RankFailed(_failure_message(failed, procs, log_dir, metrics_path), failed, procs[failed].returncode)


def _end_times(procs: list[subprocess.Popen]) -> dict[int, float]:
    """{rank: time.monotonic() when its process ended}, filled by one waiting thread per rank as they end: the
    order in which ranks failed, which a poll every 50 ms cannot tell apart (a rank's peers notice its death and
    exit within one poll)."""
    import threading

    ended: dict[int, float] = {}

    def wait(r: int, p: subprocess.Popen) -> None:
        p.wait()
        ended[r] = time.monotonic()

    for r, p in enumerate(procs):
        threading.Thread(target=wait, args=(r, p), name=f"moelab-rank{r}-wait", daemon=True).start()
    return ended


class _forward_signals:
    """While installed (main thread only), SIGTERM and SIGINT received by the launcher are sent on to its ranks
    (which checkpoint at the step boundary and end PREEMPTED) instead of killing the launcher alone."""

    def __init__(self, procs: list):
        import threading

        self.procs, self.previous, self.received = procs, {}, []
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self.previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received.append(signum)
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def restore(self) -> None:
        for s, previous in self.previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)


def _stop(procs: list[subprocess.Popen], wait_s: float = 5.0) -> None:
    """Terminate ranks still running (SIGTERM, then SIGKILL after `wait_s`)."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + wait_s
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _failure_message(rank: int, procs: list, log_dir: Path, metrics_path) -> str:
    tb = None
    if metrics_path is not None:
        try:
            events = read_events(metrics_path, live=True, typed=True)  # live: a killed writer may leave half a line
        except MetricsError:
            events = []
        errors = [e for e in events if isinstance(e, ErrorEvent) and e.rank == rank]
        tb = errors[-1].traceback if errors else None
    if not tb:
        err = (log_dir / f"rank{rank}.err").read_text(errors="replace").strip()
        tb = "\n".join(err.splitlines()[-40:]) or "(no traceback: the process wrote nothing to stderr)"
    others = ", ".join(f"rank {r}: {_describe(p.returncode)}" for r, p in enumerate(procs) if r != rank)
    return (f"rank {rank} of {len(procs)} failed ({_describe(procs[rank].returncode)}); logs: "
            f"{log_dir}/rank{rank}.out|err\nother ranks: {others}\n{tb}")


def _describe(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"


def run_local_processes(cfg: Config, run_dir: "str | Path", nproc: int, entry: str = "moelab.launch.entry",
                        env: dict | None = None, grace_s: float = 10.0) -> dict:
    """Train `cfg` on `nproc` local processes; returns the run's summary (rank 0's summary.json).

    `entry` is the module each rank runs as ``python -m ENTRY RUN_DIR`` (tests use their own); `env` adds
    environment variables to every rank."""
    run_dir = Path(run_dir)
    ParallelDims.build(cfg, nproc)  # an impossible layout fails here, before any process starts
    folder = RunFolder(run_dir)
    with lock_folder(run_dir, "local launcher"):  # its ranks write under it (FolderLock: the parent's lock)
        save_config(cfg, folder.config)
        launch([sys.executable, "-m", entry, str(run_dir)], nproc, folder.logs, env, grace_s,
               metrics_path=folder.metrics)
    return json.loads(folder.summary.read_text())
