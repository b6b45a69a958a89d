"""SLURM requests that can never run, refused before submission; why a submitted job is still pending.

SLURM accepts a job that asks for more than its partition has (EnforcePartLimits=NO, the default) and leaves it
PENDING forever. Where `sinfo` answers, `check_request` compares the request with what the partition offers and
raises ConfigError naming the option, the value, what the partition has and the fix; where it does not (no
SLURM client, or the controller does not answer), it checks nothing: submission then tells.

    check_request({"nodes": 2, "cpus_per_task": 8}, partition=None)   # None: the default partition
    # ConfigError: nodes=2: partition 'debug' has 1 node; ask for nodes <= 1 (or another partition: gpu)
    pending_reason("1234")   # "Resources (waiting for resources to be free)", None when not pending
(A job's state is asked in one place: moelab.contract.status.slurm_job_state.)

Torch-free; uses only the SLURM command-line clients.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from moelab.config import ConfigError
from moelab.launch.executor import SLURM_DEFAULT_TIME_MIN, parse_time_s

_TIMEOUT_S = 20
# squeue's %r for a pending job, and what it means to a user (the most common ones; others pass unchanged)
REASONS = {
    "Resources": "waiting for resources to be free",
    "Priority": "other jobs of higher priority go first",
    "Dependency": "waiting for a job it depends on",
    "DependencyNeverSatisfied": "a job it depends on failed: it will never start; cancel it",
    "JobHeldUser": "held by its user; release it with scontrol release",
    "JobHeldAdmin": "held by an administrator",
    "BeginTime": "its start time has not come",
    "PartitionNodeLimit": "asks for more nodes than the partition allows",
    "PartitionConfig": "asks for more CPUs, memory or GPUs per node than the partition's nodes have",
    "PartitionTimeLimit": "asks for more time than the partition allows",
    "PartitionDown": "its partition is down",
    "PartitionInactive": "its partition is inactive",
    "ReqNodeNotAvail": "a node it needs is unavailable (down, drained or reserved)",
    "BadConstraints": "no node matches its constraints (CPUs, memory, GPUs, features)",
    "QOSMaxWallDurationPerJobLimit": "asks for more time than its QOS allows",
    "AssocGrpGRES": "its account has used up its share of GPUs",
    "InvalidAccount": "its account is not valid here",
    "InvalidQOS": "its QOS is not valid here",
}


@dataclass
class Partition:
    """What sinfo says about one partition: its nodes, the largest node's CPUs, memory (MB) and GPUs, and its
    time limit in seconds (None = unlimited).

        Partition("debug", nodes=1, cpus=4, mem_mb=22899, gpus=0, max_time_s=None, default=True)
    """
    name: str
    nodes: int
    cpus: int
    mem_mb: int
    gpus: int
    max_time_s: "int | None"
    default: bool = False


def partitions() -> "list[Partition] | None":
    """Every partition sinfo lists (None when sinfo is missing or does not answer). A partition whose nodes
    differ is listed by sinfo once per kind of node: its node count is their sum, CPUs, memory and GPUs the
    largest node's (what one node can offer)."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(["sinfo", "-h", "-e", "-o", "%P|%D|%c|%m|%G|%l"], capture_output=True, text=True,
                             timeout=_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    found: dict[str, Partition] = {}
    for line in out.stdout.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 6:
            continue
        name, nodes, cpus, mem, gres, limit = fields
        default, name = name.endswith("*"), name.rstrip("*")
        part = Partition(name, _int(nodes), _int(cpus), _int(mem), _gpus(gres), _limit_s(limit), default)
        if name in found:
            old = found[name]
            part = Partition(name, old.nodes + part.nodes, max(old.cpus, part.cpus), max(old.mem_mb, part.mem_mb),
                             max(old.gpus, part.gpus), old.max_time_s, old.default or default)
        found[name] = part
    return list(found.values())


def check_request(options: dict, partition: "str | None") -> None:
    """Refuse (ConfigError) a SLURM request that the partition (None: the cluster's default) can never meet:
    nodes above its node count, cpus_per_task (times the tasks per node) or mem above a node's, GPUs where its
    nodes have none or fewer, time above its limit. `options`: the slurm executor's cluster options (moelab's
    names; `tasks_per_node` as it will be submitted). Checks nothing where sinfo does not answer."""
    found = partitions()
    if not found:
        return
    names = ", ".join(p.name for p in found)
    partition = partition or os.environ.get("SBATCH_PARTITION")  # what sbatch would take, then the default
    part = next((p for p in found if (p.name == partition if partition else p.default)), None)
    if part is None:
        if partition:
            raise ConfigError(f"partition={partition!r}: no such partition on this cluster; partitions: {names}")
        return  # no default partition: sbatch itself asks for one
    others = [p.name for p in found if p is not part]
    where, other = f"partition {part.name!r}", f" (or another partition: {', '.join(others)})" if others else ""
    nodes = int(options.get("nodes") or 1)
    if nodes > part.nodes:
        raise ConfigError(f"nodes={nodes}: {where} has {part.nodes} node{'s' * (part.nodes != 1)}; ask for "
                          f"nodes <= {part.nodes}{other}")
    gpus = int(options.get("gpus_per_node") or 0)
    tasks = gpus or int(options.get("tasks_per_node") or 1)
    cpus = options.get("cpus_per_task")
    if cpus is not None and part.cpus and int(cpus) * tasks > part.cpus:
        per = f" x {tasks} tasks per node = {int(cpus) * tasks}" if tasks > 1 else ""
        raise ConfigError(f"cpus_per_task={cpus}{per}: a node of {where} has {part.cpus} CPUs; ask for "
                          f"cpus_per_task <= {part.cpus // tasks}{other}")
    mem = options.get("mem")
    if mem is not None and part.mem_mb and _mem_mb(mem) > part.mem_mb:
        raise ConfigError(f"mem={mem!r} ({_mem_mb(mem):,} MB): a node of {where} has {part.mem_mb:,} MB; ask "
                          f"for mem <= {part.mem_mb // 1024}G{other}")
    if gpus and gpus > part.gpus:
        has = f"has {part.gpus} GPUs per node" if part.gpus else "has no GPUs (no gpu GRES)"
        fix = f"ask for gpus_per_node <= {part.gpus}" if part.gpus else "leave gpus_per_node out (a CPU job)"
        raise ConfigError(f"gpus_per_node={gpus}: {where} {has}; {fix}{other}")
    time_s = parse_time_s(options["time"]) if "time" in options else SLURM_DEFAULT_TIME_MIN * 60
    if part.max_time_s is not None and time_s > part.max_time_s:
        given = f"time={options['time']!r}" if "time" in options else f"time (default {SLURM_DEFAULT_TIME_MIN} min)"
        raise ConfigError(f"{given}: {where} allows at most {part.max_time_s // 60} minutes; ask for "
                          f"time <= {part.max_time_s // 60}{other}")


def pending_reason(job_id: "str | int") -> "str | None":
    """Why a SLURM job is still PENDING (squeue's %r, with what it means), e.g. "Resources (waiting for
    resources to be free)"; None when it is not pending, squeue does not know it, or squeue does not answer."""
    if shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T|%r"], capture_output=True, text=True,
                             timeout=_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        state, _, reason = line.strip().partition("|")
        if state == "PENDING" and reason and reason != "None":
            meaning = REASONS.get(reason.split(",")[0])
            return f"{reason} ({meaning})" if meaning else reason
    return None


def _int(text: str) -> int:
    m = re.match(r"\d+", text.strip())
    return int(m.group()) if m else 0


def _gpus(gres: str) -> int:
    """GPUs per node from sinfo's %G: "gpu:8", "gpu:h100:8(S:0-1)", "gpu:a100:4,shard:8" -> 8, 8, 4."""
    total = 0
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] == "gpu" and len(parts) > 1 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def _limit_s(limit: str) -> "int | None":
    """sinfo's %l ("infinite", "30:00", "2:00:00", "1-00:00:00") in seconds; None = unlimited."""
    try:
        return parse_time_s(limit.strip())
    except ConfigError:
        return None


def _mem_mb(mem) -> int:
    """moelab's mem (GB as a number) or SLURM's string ("64G", "500M", "1T"; no unit = MB) in MB."""
    if isinstance(mem, (int, float)) and not isinstance(mem, bool):
        return int(mem * 1024)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(mem).upper())
    if not m:
        raise ConfigError(f"mem={mem!r}: give GB as a number or SLURM's size, e.g. '64G' or '500M'")
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 ** 2}[m.group(2)]
    return int(float(m.group(1)) * scale)
