"""The run folder: the one contract between whoever writes a run and whoever reads it.

A run is a folder on a shared file system. The trainer writes the config it ran, the metrics stream, the
summary and the checkpoints; the launcher writes run.json (how to find the job again from another kernel) and
links to every rank's logs; Run, the live view, the plots and `moelab status` read (and ask for changes through
controls.jsonl). Every file name lives here (tests/contract/test_file_names.py holds what a run writes to them),
and every write of a JSON file goes through `write_json` (atomic: a reader never sees half a file). The formats
with more to them have their readers beside this module: moelab.contract.checkpoints (the checkpoint folders),
.stream and .events (metrics.jsonl), .summary (summary.json), .controls (controls.jsonl), .expert_tokens.

    folder = RunFolder("runs/tiny-20261130-101500")
    folder.config, folder.metrics, folder.summary        # Path objects: config.yaml, metrics.jsonl, summary.json
    folder.read_info()                                   # run.json as a dict ({} when there is none)
    folder.read_summary(), folder.read_fork()            # summary.json, fork.json (None when there is none)
    folder.update_info(status="CANCELLED")               # read, change, write back atomically
    folder.rank_log(0, "err")                            # logs/rank0.err

Standard library only, so every layer (train, launch, run, live) can stand on it. The read-modify-write of
run.json has one place, `update_info`. One process writes a folder at a time: its owner holds the folder's
lock (`lock_folder`, flock on .lock, naming the owner) for its whole life; a second writer is refused, be it
another process or another thread of the owner's process.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from moelab.contract.status import SLURM_ENDED, slurm_job_state
from moelab.contract.writes import write_atomic, write_if_possible, writing

CONFIG = "config.yaml"       # the config the run trains (written before any rank starts)
METRICS = "metrics.jsonl"    # the event stream (moelab.contract.stream)
SUMMARY = "summary.json"     # written by rank 0 at the end (moelab.contract.summary)
INFO = "run.json"            # executor, job id, submitit folder, options, final status (written by launch)
SWEEP = "sweep.json"         # a sweep folder's grid and runs
CHECKPOINTS = "checkpoints"  # one folder per saved step (moelab.contract.checkpoints)
LOGS = "logs"                # rank<r>.out / rank<r>.err (files, or links to the executor's files)
SUBMITIT = "submitit"        # the submitit executor's folder of a Session run
CONTROLS = "controls.jsonl"  # requests to change the running run and what the ranks did (moelab.contract.controls)
FORK = "fork.json"           # a fork's parent, step and changes (moelab.run.fork)
BENCH = "bench.json"         # `moelab bench`'s record, written by rank 0 (moelab.launch.entry)
TOKENIZER = "tokenizer.json"  # the text tokenizer the run trained with (a copy, for decoding its token ids)
EXPERT_TOKENS = "expert_tokens.jsonl"  # which token ids each expert received (moelab.contract.expert_tokens)
TENSORBOARD = "tensorboard"  # the metrics mirror's TensorBoard folder (moelab.loggers.mirror)
# inside a checkpoint folder checkpoints/step_<N>/ (moelab.contract.checkpoints; DCP's own files beside them)
CHECKPOINT_METADATA = "metadata.json"  # written last: the checkpoint is complete
CHECKPOINT_RNG = "rng"                 # rng/rank_<r>.json
CHECKPOINT_RANK_STATE = "rank_state"   # rank_state/rank_<r>.pt


def read_json(path: "str | Path") -> Any:
    """The parsed file, or None when it is missing or not (yet) valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: "str | Path", data: Any) -> None:
    """Write atomically (another kernel may be reading it): a temporary file, then os.replace; a full or
    read-only disk raises FolderWriteError and leaves no temporary file (moelab.contract.writes)."""
    write_atomic(path, json.dumps(data, indent=1))


class RunFolder:
    """The files of one run folder, by name. Creating one touches nothing on disk.

        f = RunFolder("runs/tiny")
        f.holds_run()          # False for a fresh folder
        f.write_info({"executor": "inline", "status": "RUNNING"})
    """

    def __init__(self, path: "str | Path"):
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    @property
    def name(self) -> str:
        """The folder's name (a run's default name)."""
        return self.path.name

    @property
    def config(self) -> Path:
        """config.yaml: the config the run trains."""
        return self.path / CONFIG

    @property
    def metrics(self) -> Path:
        """metrics.jsonl: the event stream."""
        return self.path / METRICS

    @property
    def summary(self) -> Path:
        """summary.json: written by rank 0 at the end."""
        return self.path / SUMMARY

    @property
    def info_path(self) -> Path:
        """run.json: how to find the job again (written by launch)."""
        return self.path / INFO

    @property
    def sweep_path(self) -> Path:
        """sweep.json: a sweep folder's grid and runs."""
        return self.path / SWEEP

    @property
    def checkpoints(self) -> Path:
        """checkpoints/: one folder per saved step (moelab.contract.checkpoints)."""
        return self.path / CHECKPOINTS

    @property
    def logs(self) -> Path:
        """logs/: every rank's rank<r>.out and rank<r>.err."""
        return self.path / LOGS

    @property
    def submitit(self) -> Path:
        """submitit/: the submitit executor's own folder."""
        return self.path / SUBMITIT

    @property
    def controls(self) -> Path:
        """controls.jsonl: live change requests and what the ranks did (moelab.contract.controls)."""
        return self.path / CONTROLS

    @property
    def fork_path(self) -> Path:
        """fork.json: a fork's parent, step and changes."""
        return self.path / FORK

    @property
    def bench(self) -> Path:
        """bench.json: the record of `moelab bench`."""
        return self.path / BENCH

    @property
    def tokenizer(self) -> Path:
        """tokenizer.json: a copy of the text tokenizer the run trained with."""
        return self.path / TOKENIZER

    @property
    def expert_tokens(self) -> Path:
        """expert_tokens.jsonl: which token ids each expert received (moelab.contract.expert_tokens)."""
        return self.path / EXPERT_TOKENS

    def rank_log(self, rank: int, suffix: str) -> Path:
        """logs/rank<rank>.<suffix>, suffix "out" or "err"."""
        return self.logs / f"rank{rank}.{suffix}"

    # ------------------------------------------------------------------ what is there
    def is_run(self) -> bool:
        """Anything a run leaves: run.json, metrics.jsonl or config.yaml."""
        return any(p.exists() for p in (self.info_path, self.metrics, self.config))

    def holds_run(self) -> bool:
        """A run was started here (run.json or a metrics stream): a new run must not reuse the folder."""
        return self.info_path.exists() or self.metrics.exists()

    def is_sweep(self) -> bool:
        """Is this a sweep's folder (it holds sweep.json)?"""
        return self.sweep_path.exists()

    # ------------------------------------------------------------------ run.json
    def read_info(self) -> dict:
        """run.json ({} when the run was started without a Session, e.g. by torchrun or an sbatch script)."""
        return read_json(self.info_path) or {}

    def write_info(self, info: dict) -> None:
        """Write run.json atomically (write_json)."""
        write_json(self.info_path, info)

    def update_info(self, **fields: Any) -> dict:
        """Merge `fields` into run.json and return the new info (read, change, write back atomically)."""
        info = {**self.read_info(), **fields}
        self.write_info(info)
        return info

    def note_info(self, **fields: Any) -> dict:
        """What a reader learnt (a final status, an owner gone) merged into run.json where the folder can be
        written, silently not where it cannot (a finished run in a read-only folder); returns the new info
        either way. Readers use this, never update_info."""
        info = {**self.read_info(), **fields}
        write_if_possible(lambda: self.write_info(info))
        return info

    def read_summary(self) -> dict | None:
        """summary.json (moelab.contract.summary.summarize), or None before the run wrote it."""
        return read_json(self.summary)

    def read_fork(self) -> dict | None:
        """fork.json: {"parent": folder, "step": k, "changes": {...}, "created": time}, or None for a run that
        is no fork (moelab.run.fork)."""
        return read_json(self.fork_path)

    def read_bench(self) -> dict | None:
        """bench.json, the record `moelab bench` wrote (moelab.train.bench.bench), or None when there is none."""
        return read_json(self.bench)

    def created(self) -> float:
        """When the run was created (run.json), else when its config was written; 0 if neither is known."""
        info = self.read_info()
        if "created" in info:
            return float(info["created"])
        try:
            return self.config.stat().st_mtime
        except OSError:
            return 0.0


# ---------------------------------------------------------------------- the writer's lock (one writer per folder)
LOCK = ".lock"  # flock'ed by the process that owns the folder; holds the owner as JSON (empty once released)
_HELD: dict[str, list] = {}  # resolved folder -> [fd, count, thread id]: the locks this process holds (re-entrant
# in the thread that took it; another thread of the process is refused as another process is)


class FolderLocked(RuntimeError):
    """Another live process or job writes this run folder; `owner` says who (pid, host, job_id, role). `why`
    replaces the advice when the owner runs on another host (what SLURM says, or how to break the lock).

        try: lock_folder("runs/a", "inline")
        except FolderLocked as e: e.owner["pid"]
    """

    def __init__(self, folder: Path, owner: dict, why: str | None = None):
        job = f", job {owner['job_id']}" if owner.get("job_id") else ""
        advice = why or self.advice(folder, owner)
        super().__init__(f"run folder {str(folder)!r} is being written by pid {owner.get('pid')} on "
                         f"{owner.get('host')}{job} ({owner.get('role', '?')}, since "
                         f"{time.strftime('%H:%M:%S', time.localtime(owner.get('since', 0)))}); {advice}")
        self.folder, self.owner = folder, owner


    @staticmethod
    def advice(folder: Path, owner: dict) -> str:
        """How to go on: an inline run (trained in its owner's foreground) stops only there; `moelab cancel`
        stops the others."""
        if (read_json(Path(folder) / INFO) or {}).get("executor") == "inline" or owner.get("role") == "inline":
            pid = owner.get("pid")
            return (f"it trains in the foreground of that process: wait for it to end, stop it there (Ctrl-C, or "
                    f"`kill -INT {pid}` on {owner.get('host')}), or choose another folder")
        return f"wait for it to end or cancel it (`moelab cancel {folder}`), or choose another folder"


def read_owner(path: "str | Path") -> dict:
    """What the folder's lock file says about its last owner ({} when none; the owner may be gone)."""
    return read_json(Path(path) / LOCK) or {}


def pid_alive(pid) -> bool:
    """Is process `pid` of this host running (a zombie counts as gone)?"""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except (OSError, ValueError, TypeError, IndexError):
        try:
            os.kill(int(pid), 0)
            return True
        except (OSError, ValueError, TypeError):
            return False


def owner_gone(owner: dict) -> bool:
    """True when `owner` (a lock file's or run.json's pid and host) was a process of this host that has ended;
    False while it runs, or when it ran elsewhere (only that host can tell)."""
    pid = owner.get("pid")
    return pid is not None and owner.get("host", socket.gethostname()) == socket.gethostname() and \
        not pid_alive(pid)


def remote_owner(owner: dict) -> tuple[str, str]:
    """For a lock owner on another host (its pid cannot be checked from here): (state, why), state "gone" when
    the lock names a SLURM job that has ended (or this very job, whose earlier attempt it was: SLURM runs one
    attempt of a job at a time), "running" while that job has not ended, else "unknown"; `why` says what is
    known and how to go on ({folder} stands for the run folder)."""
    job = owner.get("slurm_job_id")
    if job and str(job) == os.environ.get("SLURM_JOB_ID") and owner.get("pid") != os.getpid():
        return "gone", f"an earlier attempt of this SLURM job {job}"
    state = slurm_job_state(job) if job else None
    if state in SLURM_ENDED:
        return "gone", f"its SLURM job {job} is {state}"
    if state is not None:
        return "running", f"its SLURM job {job} is {state}; wait for it to end or cancel it (`scancel {job}`)"
    unknown = f"SLURM does not know its job {job}" if job else "it names no SLURM job"
    return "unknown", (f"this host cannot check that process ({unknown}); if it has ended, break the lock with "
                       f"`moelab unlock {{folder}}`")


def is_remote(owner: dict) -> bool:
    """Does the lock name an owner on another host?"""
    return bool(owner) and owner.get("host", socket.gethostname()) != socket.gethostname()


def break_lock(folder: "str | Path") -> dict:
    """Remove a run folder's lock whose owner is gone or cannot be checked from here (another host without a
    SLURM job to ask), so the next writer takes a fresh one: `moelab unlock FOLDER`. Returns the owner the lock
    named ({} when there was none). FolderLocked when the owner is known to run: a process of this host
    holding it, or a SLURM job that has not ended.

        break_lock("runs/a")   # {"pid": 4242, "host": "node7", "role": "rank 0", ...}
    """
    import fcntl

    path = Path(folder) / LOCK
    if not path.exists():
        return {}
    owner = read_owner(folder)
    if is_remote(owner):
        state, why = remote_owner(owner)
        if state == "running":
            raise FolderLocked(Path(folder), owner, why)
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if not is_remote(owner):  # held by a process of this host: it runs
            os.close(fd)
            raise FolderLocked(Path(folder), owner or {"host": socket.gethostname()}) from None
    os.unlink(path)
    os.close(fd)
    return owner


class FolderLock:
    """The advisory lock (flock on FOLDER/.lock) of the one process that writes a run folder, held for the
    owner's whole life; the kernel drops it when the owner dies, so a stale lock is simply taken over. The file
    names the owner (pid, host, SLURM job id, role), which a refusal quotes. An owner on another host is gone
    when the SLURM job it names has ended (squeue / sacct); without one it counts as holding the lock until
    `moelab unlock FOLDER` (break_lock) removes it. Re-entrant within the thread that took it (a submit that trains
inline takes it again as rank 0), refused to the process' other threads as to another process; a
    rank started by the lock's owner (its parent: moelab's local launcher) writes under its parent's lock.

        with lock_folder("runs/a", "inline"):   # FolderLocked if another live process holds it
            train()
    """

    def __init__(self, folder: "str | Path", role: str, wait_s: float = 0.0):
        self.path, self.role, self.wait_s = Path(folder), role, wait_s
        self.key: str | None = None
        self.acquired = False

    def acquire(self) -> "FolderLock":
        """Take the lock (see the class docstring). A folder that cannot be written (read-only, not ours, full)
        raises FolderWriteError naming it, and nothing is held."""
        with writing(self.path / LOCK, left="no lock was taken", then="try again"):
            return self._acquire()

    def _acquire(self) -> "FolderLock":
        import fcntl

        self.acquired = True
        self.path.mkdir(parents=True, exist_ok=True)
        key = str(self.path.resolve())
        start = time.monotonic()
        while key in _HELD and _HELD[key][2] != threading.get_ident():  # another thread of this process has it
            owner = read_owner(self.path)
            # a job started by a submit in another thread (a rank waiting with wait_s) waits for that submit to
            # end, as a rank process waits for a submitting one; without wait_s (a second submit) it is refused
            if time.monotonic() - start < self.wait_s:
                time.sleep(0.05)
                continue
            raise FolderLocked(self.path, owner, f"another thread of this process holds it (its run or submit is "
                                                 f"under way there): wait for that to end, or choose another folder")
        if key in _HELD:
            if self.role != "submit":  # the submitter trains it itself (inline): say so
                self._write_owner(_HELD[key][0], {**read_owner(self.path), "role": self.role})
            _HELD[key][1] += 1
            self.key = key
            return self
        owner = read_owner(self.path)
        if owner.get("pid") == os.getppid() and owner.get("host") == socket.gethostname() and pid_alive(owner["pid"]):
            return self  # our launcher holds it for us
        lock_file = self.path / LOCK
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        start, broken = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = False
            except BlockingIOError:
                held = True
            owner = read_owner(self.path)
            # a lock naming another host's owner says nothing by flock alone (a file system may not share flocks
            # between hosts): SLURM decides when the lock names a job, else it stays held (`moelab unlock`)
            state, why = remote_owner(owner) if is_remote(owner) else ("running" if held else "gone", None)
            if state == "gone" and not held:
                break
            if state == "gone" and not broken:  # the flock of a host whose job ended: start a fresh lock file
                os.close(fd)
                os.unlink(lock_file)
                fd, broken = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644), True
                continue
            if not held:
                fcntl.flock(fd, fcntl.LOCK_UN)
            waited = time.monotonic() - start
            # a submitter holds the lock only until run.json is written: the job it submitted waits for it;
            # no owner named yet is a lock being taken or released this instant
            if (owner.get("role") == "submit" and waited < self.wait_s) or (not owner and waited < 5.0):
                time.sleep(0.2)
                continue
            os.close(fd)
            raise FolderLocked(self.path, owner, why and why.replace("{folder}", str(self.path)))
        me = {"pid": os.getpid(), "host": socket.gethostname(), "role": self.role, "since": time.time(),
              "job_id": os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID"),
              "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
        try:
            self._write_owner(fd, me)
        except OSError:
            os.close(fd)  # a full disk: the flock goes with the fd, nothing stays held
            raise
        _HELD[key] = [fd, 1, threading.get_ident()]
        self.key = key
        return self

    @staticmethod
    def _write_owner(fd: int, owner: dict) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)

    def release(self) -> None:
        """Release one hold of the lock; the last one empties the owner and unlocks the file."""
        import fcntl

        if self.key is None or self.key not in _HELD:
            return
        held = _HELD[self.key]
        held[1] -= 1
        if held[1] == 0:
            del _HELD[self.key]
            os.ftruncate(held[0], 0)  # released cleanly: no owner to report
            fcntl.flock(held[0], fcntl.LOCK_UN)
            os.close(held[0])
        self.key = None

    def __enter__(self) -> "FolderLock":
        return self if self.acquired else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_folder(folder: "str | Path", role: str, wait_s: float = 0.0) -> FolderLock:
    """Take the writer's lock of `folder` (see FolderLock); raises FolderLocked naming a live owner."""
    return FolderLock(folder, role, wait_s).acquire()
