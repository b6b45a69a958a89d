"""The executors' registry and the built-in ones: inline (this process: moelab.launch.inline), local (submitit's
LocalExecutor) and slurm (submitit's SlurmExecutor); and the job every task of the last two runs.

    ex = get_executor("slurm")                # an Executor (moelab.launch.executor); "auto": slurm where sbatch is
    ex.check_options({"gpus_per_node": 8, "nodes": 2, "time": 60}); ex.world_size(1, {"gpus_per_node": 8})  # 8
    job_for(RunFolder("runs/tiny"))           # the Job of a run, from the executor its run.json names
    register_executor(MyExecutor())           # a new executor: its own file and this one call

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
import shlex
import shutil
import subprocess
import time
import zlib
from pathlib import Path
from typing import Any

from moelab.config import ConfigError
from moelab.contract.folder import RunFolder
from moelab.launch.executor import SLURM_DEFAULT_TIME_MIN, Executor, parse_time_s  # noqa: F401 (read from here)
from moelab.launch.inline import InlineExecutor
from moelab.launch.jobs import ExternalJob, Job, LocalJob, SlurmJob

MOELAB_OPTIONS = ("nodes", "gpus_per_node", "tasks_per_node", "cpus_per_task", "mem", "time", "partition",
                  "account", "qos", "constraint", "setup", "job_name", "signal_delay_s", "max_num_timeout",
                  "array_parallelism", "sbatch")
LOCAL_OPTIONS = ("nodes", "gpus_per_node", "tasks_per_node", "time", "setup", "signal_delay_s", "max_num_timeout",
                 "job_name")
# submitit writes the sbatch header itself from these; a user never sets them
_SUBMITIT_INTERNAL = {"ntasks_per_node", "array_parallelism", "additional_parameters", "use_srun",
                      "stderr_to_stdout", "map_count", "num_gpus", "wckey"}
LOCAL_DEFAULT_TIME_MIN = 7 * 24 * 60  # submitit's LocalExecutor would otherwise kill a job after 2 minutes


def slurm_parameter_names() -> list[str]:
    """Every cluster option name accepted for the slurm executor."""
    from submitit.slurm.slurm import _get_default_parameters

    return sorted(set(MOELAB_OPTIONS) | (set(_get_default_parameters()) - _SUBMITIT_INTERNAL))


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


class SubmititExecutor(Executor):
    """What the local and slurm executors share: submitit runs TrainJob on every task, several folders go out in
    one batch (one job array on SLURM), run.json records the job and logs/ links to submitit's files.

        LocalExecutor().submit([folder], 2, {}, folder.submitit, world=2)   # [LocalJob]
    """

    def check_options(self, options: dict) -> None:
        super().check_options(options)
        for name in ("nodes", "gpus_per_node", "tasks_per_node", "cpus_per_task", "max_num_timeout"):
            v = options.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (0 if name in (
                    "max_num_timeout", "gpus_per_node") else 1)):
                raise ConfigError(f"{name}={v!r}: expected a whole number >= {0 if name == 'max_num_timeout' else 1}")

    def world_size(self, nproc: int, options: dict) -> int:
        super().world_size(nproc, options)
        return int(options.get("nodes", 1)) * tasks_per_node(nproc, options)

    def resume_nproc(self, info: dict, options: dict) -> int:
        return 1 if options.get("gpus_per_node") else int(info.get("ntasks", 1)) // int(options.get("nodes", 1))

    def make(self, folder: Path, nproc: int, options: dict):
        """A configured submitit executor writing into `folder` (options already checked)."""
        raise NotImplementedError

    def submit(self, folders: list, nproc: int, options: dict, submitit_folder, world: int) -> list[Job]:
        folders = [f if isinstance(f, RunFolder) else RunFolder(f) for f in folders]
        ex = self.make(Path(submitit_folder), nproc, options)
        handles = []
        if len(folders) == 1:
            handles.append(ex.submit(TrainJob(folders[0].path)))
        else:
            with ex.batch():
                for f in folders:
                    handles.append(ex.submit(TrainJob(f.path)))
        time_s = parse_time_s(options["time"]) if "time" in options else None
        jobs = []
        for folder, handle in zip(folders, handles):
            array_id = str(handle.job_id).split("_")[0] if "_" in str(handle.job_id) else None
            info = {"name": folder.name, "executor": self.name, "created": time.time(), "job_id": str(handle.job_id),
                    "array_job_id": array_id, "submitit_folder": str(Path(submitit_folder).resolve()),
                    "ntasks": world, "time_limit_s": time_s, "options": _jsonable(options)}
            folder.write_info(info)
            job = self.job(folder, info, handle)
            _link_logs(job, world)
            jobs.append(job)
        return jobs


def _common(nproc: int, options: dict, folder: Path, setup_log: bool) -> tuple[dict, int, int | None, list | None,
                                                                              int, int]:
    """What both submitit executors read first: (the rest of the options, tasks per node, the time limit in
    seconds or None, the setup lines guarded by guard_setup, nodes, requeues). `setup_log`: a failing setup line
    is also written to task 0's stderr file (the local executor's setup shell writes to no log of the job's)."""
    options = dict(options)
    tpn = tasks_per_node(nproc, options)
    time_s = parse_time_s(options.pop("time")) if "time" in options else None
    setup = options.pop("setup", None)
    if isinstance(setup, str):
        setup = [setup]
    if setup:  # the local controller's shell pid ($$) is its job id: the message goes to task 0's stderr file
        log = f"{shlex.quote(str(Path(folder).expanduser().absolute()))}/$$_0_log.err" if setup_log else None
        setup = guard_setup(setup, log)
    nodes = int(options.pop("nodes", 1))
    options.pop("tasks_per_node", None)
    requeues = int(options.pop("max_num_timeout", 3))
    return options, tpn, time_s, setup, nodes, requeues


class LocalExecutor(SubmititExecutor):
    """Background processes on this machine under one controller (submitit's LocalExecutor, in its own session:
    a kernel's interrupt, restart or shutdown leaves the run training).

        LocalExecutor().check_options({"nodes": 2})   # ConfigError: the local executor runs on this machine only
    """

    name, job_class, options = "local", LocalJob, LOCAL_OPTIONS

    def check_options(self, options: dict) -> None:
        super().check_options(options)
        if options.get("nodes", 1) != 1:
            raise ConfigError(f"nodes={options['nodes']!r}: the local executor runs on this machine only; "
                              f"use nodes=1 or executor='slurm'")

    def make(self, folder: Path, nproc: int, options: dict):
        from moelab.launch.detached import DetachedLocalExecutor

        options, tpn, time_s, setup, _, requeues = _common(nproc, options, folder, setup_log=True)
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


class SlurmExecutor(SubmititExecutor):
    """sbatch through submitit's SlurmExecutor: every option submitit knows, moelab's names, sbatch={...} flags.

        SlurmExecutor().world_size(1, {"nodes": 2, "gpus_per_node": 8})   # 16
    """

    name, job_class = "slurm", SlurmJob

    def option_names(self) -> list[str]:
        return slurm_parameter_names()

    def options_hint(self, valid: list[str]) -> str:
        return f"{super().options_hint(valid)}; extra sbatch flags go in sbatch={{...}}"

    def check_request(self, nproc: int, options: dict) -> None:
        """Issue 21: a request the partition can never meet is refused here, not left pending."""
        from moelab.launch.slurm_checks import check_request

        check_request({**options, "tasks_per_node": tasks_per_node(nproc, options)}, options.get("partition"))

    def make(self, folder: Path, nproc: int, options: dict):
        import submitit

        options, tpn, time_s, setup, nodes, requeues = _common(nproc, options, folder, setup_log=False)
        time_s = SLURM_DEFAULT_TIME_MIN * 60 if time_s is None else time_s
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=requeues)
        extra = dict(options.pop("sbatch", None) or {})
        if "job_name" not in options:
            options["job_name"] = "moelab"
        mem = options.pop("mem", None)
        if mem is not None:
            options["mem"] = f"{mem:g}G" if isinstance(mem, (int, float)) else str(mem)
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


# ---------------------------------------------------------------------- the registry
EXECUTORS: dict[str, Executor] = {ex.name: ex for ex in (InlineExecutor(), LocalExecutor(), SlurmExecutor())}
BUILT_IN = frozenset(EXECUTORS)


def register_executor(executor: Executor) -> Executor:
    """Make `executor` available by its name (Session.submit(name), `moelab run --executor name`, run.json);
    registering a name again replaces it (a notebook cell may run twice); the built-in ones stay. Returns it."""
    if not isinstance(executor, Executor) or not isinstance(executor.name, str) or not executor.name:
        raise TypeError(f"register_executor({executor!r}): give an Executor instance with a non-empty name")
    if executor.name in BUILT_IN | {"auto", "external"} and EXECUTORS.get(executor.name) is not executor:
        raise ValueError(f"executor {executor.name!r} is built in; register yours under another name")
    EXECUTORS[executor.name] = executor
    return executor


def unregister_executor(name: str) -> None:
    """Forget a registered executor (not a built-in one); an unknown name is ignored."""
    if name in BUILT_IN:
        raise ValueError(f"executor {name!r} is built in and stays registered")
    EXECUTORS.pop(name, None)


def get_executor(name: str) -> Executor:
    """The executor `name` names; 'auto' is slurm where sbatch is on PATH, else local."""
    if name == "auto":
        name = "slurm" if shutil.which("sbatch") else "local"
    if name not in EXECUTORS:
        raise ConfigError(f"executor={name!r}: choose one of {[*EXECUTORS, 'auto']}")
    return EXECUTORS[name]


def resolve_executor(name: str) -> str:
    """'auto' -> 'slurm' where sbatch is on PATH, else 'local'; other names are checked and returned."""
    return get_executor(name).name


def job_for(folder: "RunFolder | str | Path", info: dict | None = None, handle=None) -> Job:
    """The Job of a run folder, from the executor its run.json names; a folder without one (torchrun, a script,
    slurm/moelab.sbatch), or naming an executor this process has not registered, gets an ExternalJob, which
    reads the run's stream (and SLURM, where the stream names a job)."""
    folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
    info = info if info is not None else folder.read_info()
    executor = EXECUTORS.get(info.get("executor", "external"))
    return executor.job(folder, info, handle) if executor is not None else ExternalJob(folder, info, handle)


def _link_logs(job: Job, world: int) -> None:
    """logs/rank<k>.out and .err -> submitit's files, so a user finds them from the run folder."""
    folder = job.folder
    folder.logs.mkdir(exist_ok=True)
    for rank in range(world):
        paths = job.paths(rank)
        for suffix, target in (("out", paths.stdout), ("err", paths.stderr)):
            link = folder.rank_log(rank, suffix)
            if not link.is_symlink() and not link.exists():
                link.symlink_to(os.path.relpath(target, folder.logs))


def _jsonable(options: dict) -> dict:
    return {k: v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else str(v)
            for k, v in options.items()}


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

        job = LocalExecutor().make(folder, 1, {}).submit(TrainJob("runs/tiny"))
    """

    def __init__(self, run_dir: "str | Path"):
        self.run_dir = str(run_dir)

    def __call__(self) -> dict:
        import submitit

        from moelab.launch.entry import end_at_exit, quiet_idle_threads, train_rank
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
            summary = train_rank(self.run_dir)
        except subprocess.CalledProcessError as e:  # from the requeue that the trainer chained to, after its end
            if not requeue_refused(e):
                raise
            summary = not_requeued(self.run_dir, e)
        end_at_exit(0)  # submitit saves the result, then the task ends without finalising (entry.end_process)
        return summary

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
    from moelab.contract.stream import MetricsWriter, tail_events

    folder = RunFolder(run_dir)
    ends = tail_events(folder.metrics, kinds=("end",))[0]
    step = ends[-1].step if ends else None
    job = " ".join(map(str, error.cmd[2:])) if hasattr(error, "cmd") else "?"
    message = (f"SLURM refused to requeue job {job} (`{' '.join(map(str, error.cmd))}` failed: requeueing is off "
               f"on this cluster, JobRequeue=0, or for this job, --no-requeue); the run ends PREEMPTED with its "
               f"checkpoint at step {step}: continue it with `moelab resume {folder.path}`")
    print(f"moelab: {message}", file=sys.stderr)
    MetricsWriter(folder.metrics).emit(WarningEvent(step=step, kind="not_requeued", message=message))
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
