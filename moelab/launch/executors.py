"""Where a run executes: inline (this process), local (submitit's LocalExecutor) or slurm (submitit's
SlurmExecutor), and the job every task runs.

    ex = make_executor("slurm", folder, nproc=1, options={"gpus_per_node": 8, "nodes": 2, "time": 60})
    job = ex.submit(TrainJob(run_dir))        # every task: torch.distributed from SLURM -> train_rank(run_dir)

Cluster options (``Session.submit(..., **options)``), checked before anything is submitted:

- moelab's names: nodes, gpus_per_node (one task per GPU), tasks_per_node (CPU jobs; default nproc),
  cpus_per_task, mem (GB as a number, or SLURM's "64G"), time (minutes as a number, or "H:MM:SS" / "M:SS";
  SLURM enforces whole minutes, so seconds are rounded up there; default 60 minutes on SLURM, none
  locally), partition, account, qos, constraint,
  setup (shell lines run before the tasks: module load, conda activate), job_name, signal_delay_s (how long
  before the limit the job is told to checkpoint), max_num_timeout (how often a job that reaches its time
  limit is requeued to continue from its checkpoint; default 3, 0 = end as TIMEOUT at the first limit),
  array_parallelism (sweeps).
- every other parameter that submitit's SlurmExecutor knows (exclude, gres, mail_type, comment, exclusive,
  nodelist, dependency, srun_args, mem_per_gpu, ...), passed through unchanged;
- ``sbatch={"reservation": "r1", "mail-type": "END"}``: any further sbatch flag, written as-is
  (submitit's additional_parameters).

An unknown name is an error that lists the valid ones (a typo never silently becomes an sbatch flag). The
local executor honours nodes=1, gpus_per_node, tasks_per_node, time, setup and signal_delay_s, and rejects
SLURM-only options.
"""
from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
import zlib
from pathlib import Path
from typing import Any

from moelab.config import ConfigError

EXECUTORS = ("inline", "local", "slurm", "auto")
MOELAB_OPTIONS = ("nodes", "gpus_per_node", "tasks_per_node", "cpus_per_task", "mem", "time", "partition",
                  "account", "qos", "constraint", "setup", "job_name", "signal_delay_s", "max_num_timeout",
                  "array_parallelism", "sbatch")
LOCAL_OPTIONS = ("nodes", "gpus_per_node", "tasks_per_node", "time", "setup", "signal_delay_s", "max_num_timeout",
                 "job_name")
# submitit writes the sbatch header itself from these; a user never sets them
_SUBMITIT_INTERNAL = {"ntasks_per_node", "array_parallelism", "additional_parameters", "use_srun",
                      "stderr_to_stdout", "map_count", "num_gpus", "wckey"}
LOCAL_DEFAULT_TIME_MIN = 7 * 24 * 60  # submitit's LocalExecutor would otherwise kill a job after 2 minutes
SLURM_DEFAULT_TIME_MIN = 60           # submitit's default is 5 minutes


def resolve_executor(name: str) -> str:
    """'auto' -> 'slurm' where sbatch is on PATH, else 'local'; other names are checked and returned."""
    if name not in EXECUTORS:
        raise ConfigError(f"executor={name!r}: choose one of {list(EXECUTORS)}")
    if name == "auto":
        return "slurm" if shutil.which("sbatch") else "local"
    return name


def slurm_parameter_names() -> list[str]:
    """Every cluster option name accepted for the slurm executor."""
    from submitit.slurm.slurm import _get_default_parameters

    return sorted(set(MOELAB_OPTIONS) | (set(_get_default_parameters()) - _SUBMITIT_INTERNAL))


def check_options(executor: str, options: dict) -> None:
    """Raise ConfigError naming every unknown option and listing the valid ones."""
    if executor == "inline":
        valid: list[str] = []
    elif executor == "local":
        valid = list(LOCAL_OPTIONS)
    else:
        valid = slurm_parameter_names()
    unknown = sorted(set(options) - set(valid))
    if unknown:
        where = ("the inline executor takes no cluster options (it runs in this process)" if executor == "inline"
                 else f"valid {executor} options: {', '.join(valid)}")
        hint = "; extra sbatch flags go in sbatch={...}" if executor == "slurm" else ""
        raise ConfigError(f"cluster option(s) {unknown} are unknown for executor={executor!r}; {where}{hint}")
    for name in ("nodes", "gpus_per_node", "tasks_per_node", "cpus_per_task", "max_num_timeout"):
        v = options.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (0 if name in (
                "max_num_timeout", "gpus_per_node") else 1)):
            raise ConfigError(f"{name}={v!r}: expected a whole number >= {0 if name == 'max_num_timeout' else 1}")
    if executor == "local" and options.get("nodes", 1) != 1:
        raise ConfigError(f"nodes={options['nodes']!r}: the local executor runs on this machine only; "
                          f"use nodes=1 or executor='slurm'")


def tasks_per_node(nproc: int, options: dict) -> int:
    """One task per GPU when gpus_per_node is given, else tasks_per_node or nproc."""
    gpus = int(options.get("gpus_per_node") or 0)
    tpn = options.get("tasks_per_node")
    if gpus and tpn and int(tpn) != gpus:
        raise ConfigError(f"tasks_per_node={tpn} with gpus_per_node={gpus}: moelab runs one task per GPU; "
                          f"drop tasks_per_node")
    if gpus and nproc not in (1, gpus):
        raise ConfigError(f"nproc={nproc} with gpus_per_node={gpus}: moelab runs one task per GPU; "
                          f"give one of them")
    return gpus or int(tpn or nproc)


def world_size(executor: str, nproc: int, options: dict) -> int:
    if nproc < 1:
        raise ConfigError(f"nproc={nproc}: must be >= 1")
    if executor == "inline":
        if nproc != 1:
            raise ConfigError(f"nproc={nproc}: the inline executor runs one rank in this process; "
                              f"use executor='local' for several processes")
        return 1
    return int(options.get("nodes", 1)) * tasks_per_node(nproc, options)


def parse_time_s(value: Any) -> int:
    """A time limit in seconds from minutes (a number) or SLURM's "M:SS", "H:MM:SS", "D-H:MM:SS"."""
    if isinstance(value, bool):
        raise ConfigError(f"time={value!r}: give minutes (a number) or 'H:MM:SS'")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ConfigError(f"time={value!r}: must be > 0 minutes")
        return int(round(value * 60))
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", str(value).strip())
    if not m:
        raise ConfigError(f"time={value!r}: give minutes (a number) or SLURM's 'M:SS', 'H:MM:SS', 'D-H:MM:SS'")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if c is not None:                     # H:MM:SS
        secs = a * 3600 + b * 60 + c
    elif b is not None:                   # M:SS, or D-H:MM
        secs = a * 3600 + b * 60 if days is not None else a * 60 + b
    else:                                 # minutes, or D-H
        secs = a * 3600 if days is not None else a * 60
    secs += (days or 0) * 86400
    if secs <= 0:
        raise ConfigError(f"time={value!r}: must be > 0")
    return secs


def make_executor(executor: str, folder: Path, nproc: int, options: dict):
    """A configured submitit executor for 'local' or 'slurm' (options already checked)."""
    import submitit

    options = dict(options)
    tpn = tasks_per_node(nproc, options)
    time_s = parse_time_s(options.pop("time")) if "time" in options else None
    if executor == "slurm" and time_s is None:
        time_s = SLURM_DEFAULT_TIME_MIN * 60
    setup = options.pop("setup", None)
    if isinstance(setup, str):
        setup = [setup]
    if setup:  # the local controller's shell pid ($$) is its job id: the message goes to task 0's stderr file
        log = f"{shlex.quote(str(Path(folder).expanduser().absolute()))}/$$_0_log.err" if executor == "local" else None
        setup = guard_setup(setup, log)
    nodes = int(options.pop("nodes", 1))
    options.pop("tasks_per_node", None)
    requeues = int(options.pop("max_num_timeout", 3))
    if executor == "local":
        from moelab.launch.detached import DetachedLocalExecutor

        # its own session: a kernel's interrupt, restart or shutdown leaves the run training
        ex = DetachedLocalExecutor(folder=folder, max_num_timeout=requeues)
        params: dict[str, Any] = {"tasks_per_node": tpn, "timeout_min": (time_s or LOCAL_DEFAULT_TIME_MIN * 60) / 60}
        if options.get("gpus_per_node"):
            params["gpus_per_node"] = int(options["gpus_per_node"])
        if setup:
            params["setup"] = list(setup)
        if "signal_delay_s" in options:
            params["signal_delay_s"] = int(options["signal_delay_s"])
        elif time_s:
            params["signal_delay_s"] = _signal_delay(time_s)
        ex.update_parameters(**params)
        return ex
    ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=requeues)
    extra = dict(options.pop("sbatch", None) or {})
    if "job_name" not in options:
        options["job_name"] = "moelab"
    mem = options.pop("mem", None)
    if mem is not None:
        options["mem"] = f"{mem:g}G" if isinstance(mem, (int, float)) else str(mem)
    if time_s is not None:
        # SLURM keeps time limits in whole minutes (a "0:40" limit is stored as 1 minute)
        options["time"] = max(1, math.ceil(time_s / 60))
        options.setdefault("signal_delay_s", _signal_delay(options["time"] * 60))
    if setup:
        options["setup"] = list(setup)
    # a rank that dies ends the job at once, instead of its peers waiting in a collective until the timeout
    options.setdefault("srun_args", ["--kill-on-bad-exit=1"])
    ex.update_parameters(ntasks_per_node=tpn, nodes=nodes, **options)
    if extra:
        ex.update_parameters(additional_parameters=extra)
    return ex


def guard_setup(lines: list[str], log: str | None = None) -> list[str]:
    """Each setup line as run before the tasks, guarded: a line that fails ends the job at once and says so on
    the job's stderr (which Run.error and `moelab status` show), instead of a job that ends FAILED without an
    error message (a silent `false`, `conda activate` of a missing env) or trains in a half-set-up shell. A line
    that exits the shell itself (`exit 3`) still ends the job, without the message. `log`: a file (shell words)
    the message is appended to as well: the local executor's setup shell writes to no log of the job's."""
    to = f"| tee -a {log} >&2" if log else ">&2"
    return [f"{{ {line}\n}} || {{ code=$?; printf 'moelab: the setup line `%s` failed with exit code %s; no rank "
            f"started\\n' {shlex.quote(line)} \"$code\" {to}; exit \"$code\"; }}" for line in lines]


def _signal_delay(time_s: int) -> int:
    """Seconds before the limit at which the job is told it is about to end (submitit's default is 90 s,
    which for a short limit would arrive at once)."""
    return int(max(5, min(90, time_s // 5)))


class TrainJob:
    """What every task of a submitted run executes: torch.distributed from submitit's view of the job
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), then the one entry point. Lives in the installed
    package so that jobs unpickle anywhere; a callable class so that checkpoint() can be added for requeue.

        job = make_executor("local", folder, 1, {}).submit(TrainJob("runs/tiny"))
    """

    def __init__(self, run_dir: "str | Path"):
        self.run_dir = str(run_dir)

    def __call__(self) -> dict:
        import submitit

        from moelab.launch.entry import quiet_idle_threads, train_rank
        from moelab.launch.warm import die_with_parent

        die_with_parent()  # the controller (local) or slurmstepd gone: checkpoint and stop, never an orphan
        quiet_idle_threads()  # before torch is imported
        # every task derives the same port from the job id (an inherited MASTER_PORT would be shared by all jobs)
        os.environ["MASTER_PORT"] = str(master_port(submitit.JobEnvironment().job_id))
        # one GPU per task: DistEnv picks cuda:<local_rank % visible devices>, which is right whether SLURM
        # shows each task all the node's GPUs or only its own, so CUDA_VISIBLE_DEVICES is left alone
        dist = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False,
                                                                      overwrite=True)
        _limit_cpu_threads(dist.local_world_size)
        try:
            return train_rank(self.run_dir)
        except subprocess.CalledProcessError as e:  # from the requeue that the trainer chained to, after its end
            if not requeue_refused(e):
                raise
            return not_requeued(self.run_dir, e)

    def checkpoint(self, *args, **kwargs):
        """submitit calls this on preemption or at the time limit (its signal, USR2), from the handler that the
        trainer chains to only after it saved a checkpoint at the step boundary (moelab.train.signals):
        submitit then requeues this same job, which resumes from that checkpoint. Where SLURM refuses the
        requeue (JobRequeue=0, --no-requeue), the job ends there: PREEMPTED, resumed by hand (`not_requeued`)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    def __repr__(self) -> str:
        return f"TrainJob({self.run_dir!r})"


def requeue_refused(error: BaseException) -> bool:
    """Is `error` submitit's `scontrol requeue JOB` failing (what SLURM answers where requeueing is off: "Requested
    operation is presently disabled")?"""
    cmd = getattr(error, "cmd", None) if isinstance(error, subprocess.CalledProcessError) else None
    return isinstance(cmd, (list, tuple)) and list(cmd[:2]) == ["scontrol", "requeue"]


def not_requeued(run_dir: "str | Path", error: BaseException) -> dict:
    """After a stop whose requeue SLURM refused: the run has saved its checkpoint and written its end (PREEMPTED),
    so the job ends cleanly (the scheduler's COMPLETED reads PREEMPTED: moelab.contract.status.reconcile) with a
    warning event that says why and how to continue. Returns the run's summary."""
    import sys

    from moelab.contract.events import WarningEvent
    from moelab.contract.folder import RunFolder, read_json
    from moelab.contract.stream import append_event, tail_events

    folder = RunFolder(run_dir)
    ends = tail_events(folder.metrics, kinds=("end",))[0]
    step = ends[-1].step if ends else None
    job = " ".join(map(str, error.cmd[2:])) if hasattr(error, "cmd") else "?"
    message = (f"SLURM refused to requeue job {job} (`{' '.join(map(str, error.cmd))}` failed: requeueing is off "
               f"on this cluster, JobRequeue=0, or for this job, --no-requeue); the run ends PREEMPTED with its "
               f"checkpoint at step {step}: continue it with `moelab resume {folder.path}`")
    print(f"moelab: {message}", file=sys.stderr)
    append_event(folder.metrics, WarningEvent(step=step, kind="not_requeued", message=message))
    return read_json(folder.summary) or {}


def master_port(job_id: str) -> int:
    """The rendezvous port of a job: derived from its id, and below the kernel's ephemeral port range, where
    the sockets of other processes (gloo opens many) would otherwise sometimes hold it (EADDRINUSE)."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    span = low - 20000 if low > 21000 else 10000
    return 20000 + zlib.crc32(str(job_id).encode()) % span


def _limit_cpu_threads(local_world: int) -> None:
    """Tasks sharing a node's cores should not each start one thread per core (on CPU that oversubscribes
    the machine several times over); the cores are those this process may run on (taskset, a cgroup's cpuset),
    not all the machine has."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # taskset
    cpus = int(os.environ.get("SLURM_CPUS_PER_TASK") or 0) or max(1, usable // local_world)
    torch.set_num_threads(cpus)
