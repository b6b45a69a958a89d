"""An Executor: one place a run trains (inline, local, slurm, ...), one object each, in one registry
(moelab.launch.executors.EXECUTORS, which run.json's "executor" names). Session.submit, `moelab run`, resume, fork,
the CLI and the dashboard ask the executor, never compare its name: which cluster options it takes, how many ranks
a request makes, how folders are submitted, which Job answers for a run it started (state, cancel, logs), and
whether it trains apart from the submitting process.

    class Here(Executor):
        '''Trains in this process, like inline.'''
        name, job_class, in_background = "here", InlineJob, False

        def submit(self, folders, nproc, options, submitit_folder, world):
            return [run_inline(f, executor=self.name) for f in folders]

    register_executor(Here())                 # moelab.launch.executors
    Session("tiny").submit("here").status     # COMPLETED

A new executor is such a class in its own file and one register_executor call; tests/launch/test_executor_registry.py
does it with a fake one.
"""
from __future__ import annotations

import re
from typing import Any

from moelab.config import ConfigError

SLURM_DEFAULT_TIME_MIN = 60  # submitit's default is 5 minutes


class Executor:
    """The questions every part of moelab asks an executor; a subclass answers them for one kind of place.

        ex = get_executor("local")                     # moelab.launch.executors
        ex.check_options({"time": 30}); ex.world_size(2, {})   # 2
    """

    name: str = ""
    job_class: type                 # the Job of a run it started (moelab.launch.jobs): state, cancel, logs
    options: tuple = ()             # the cluster options it takes; any other is refused, the valid ones listed
    in_background: bool = True      # submit returns while the run trains (False: the run has ended by then)

    def option_names(self) -> list[str]:
        """Every cluster option name this executor accepts."""
        return list(self.options)

    def options_hint(self, valid: list[str]) -> str:
        """What the refusal of an unknown option says after naming it."""
        return f"valid {self.name} options: {', '.join(valid)}" if valid else (
            f"the {self.name} executor takes no cluster options")

    def check_options(self, options: dict) -> None:
        """ConfigError naming every unknown option and listing the valid ones."""
        valid = self.option_names()
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ConfigError(f"cluster option(s) {unknown} are unknown for executor={self.name!r}; "
                              f"{self.options_hint(valid)}")

    def world_size(self, nproc: int, options: dict) -> int:
        """The ranks a request of `nproc` processes with `options` makes (options already checked)."""
        if nproc < 1:
            raise ConfigError(f"nproc={nproc}: must be >= 1")
        return nproc

    def check_request(self, nproc: int, options: dict) -> None:
        """Refuse a request the executor's resources can never meet (before anything is submitted)."""

    def submit(self, folders: list, nproc: int, options: dict, submitit_folder, world: int) -> list:
        """Start training each prepared run folder (config.yaml written, the folder claimed); write its run.json
        naming this executor; return one Job per folder."""
        raise NotImplementedError

    def resume_nproc(self, info: dict, options: dict) -> int:
        """The processes per node a resume asks for when none is given, from the run's run.json `info`."""
        return int(info.get("ntasks", 1))

    def job(self, folder, info: dict, handle=None):
        """The Job of a run this executor started (`info`: its run.json; `handle`: the executor's own job object
        where this process submitted it)."""
        return self.job_class(folder, info, handle)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


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
