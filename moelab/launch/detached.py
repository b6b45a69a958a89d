"""submitit's LocalExecutor with its controller in a process session of its own (setsid), so that what stops
the submitting process (a notebook kernel's interrupt, restart or shutdown: jupyter kills the kernel's whole
process group; a terminal's Ctrl-C) leaves the run training. `Run.load(folder)` reattaches to it from any
kernel, and `Run.cancel()` / `moelab cancel` stop it.

    ex = DetachedLocalExecutor(folder="runs/x/submitit")
    ex.update_parameters(tasks_per_node=2, timeout_min=60)
    job = ex.submit(TrainJob("runs/x"))     # the controller's pid is the job id, as with submitit's executor
"""
from __future__ import annotations

import os
import subprocess
import sys

import submitit
from submitit.local.local import LocalJob

from moelab.launch import warm


class DetachedLocalJob(LocalJob):
    """submitit's LocalJob, quiet at interpreter exit: its ``__del__`` tidies submitit's table of live processes
    through path helpers that are already torn down then ("Exception ignored in LocalJob.__del__ ... TypeError"
    after every script that submitted locally). The table dies with the interpreter, so there is nothing to tidy.

        job = DetachedLocalJob(folder="runs/x/submitit", job_id="4242", process=proc, tasks=[0])
    """

    def __del__(self) -> None:
        if not sys.is_finalizing():
            super().__del__()


class DetachedLocalExecutor(submitit.LocalExecutor):
    """A LocalExecutor whose controller starts in a new session (see the module docstring).

        job = DetachedLocalExecutor(folder="runs/x/submitit").submit(TrainJob("runs/x"))
    """

    def _submit_command(self, command: str) -> LocalJob:
        warm.start()  # a rank forked from a process that already imported torch and moelab (moelab.launch.warm)
        command = warm.client_command(command)
        ntasks = self.parameters.get("tasks_per_node", 1)
        n_gpus = self.parameters.get("gpus_per_node", 0)
        visible = self.parameters.get("visible_gpus", ())
        gpus = range(n_gpus) if visible == () else visible[:n_gpus]
        setup = list(self.parameters.get("setup", ()))
        env = {**os.environ,  # what submitit.local.local.start_controller gives its controller
               "SUBMITIT_LOCAL_NTASKS": str(ntasks), "SUBMITIT_LOCAL_COMMAND": command,
               "SUBMITIT_LOCAL_TIMEOUT_S": str(int(60 * self.parameters.get("timeout_min", 2.0))),
               "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(int(self.parameters.get("signal_delay_s", 30))),
               "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
               "SUBMITIT_STDERR_TO_STDOUT": "1" if self.parameters.get("stderr_to_stdout") else "",
               "SUBMITIT_EXECUTOR": "local", "CUDA_VISIBLE_DEVICES": ",".join(str(k) for k in gpus),
               "SUBMITIT_LOCAL_WITH_SHELL": "1" if setup else ""}
        cmd = [sys.executable, "-m", "submitit.local._local", str(self.folder)]
        if setup:
            import shlex

            cmd = " && ".join(setup + [shlex.join(cmd)])
        process = subprocess.Popen(cmd, shell=bool(setup), env=env, start_new_session=True,
                                   stdin=subprocess.DEVNULL)
        return DetachedLocalJob(folder=self.folder, job_id=str(process.pid), process=process,
                                tasks=list(range(ntasks)))
