"""A new executor is one class and one registration (moelab.launch.executor, moelab.launch.executors): this file
writes one that trains in a thread of this process, registers it, and Session.submit, Run (status, wait,
Run.load), resume and `moelab run` use it without any other module knowing its name."""
import threading
import time

import pytest

from moelab import Run
from moelab.cli import main
from moelab.config import ConfigError
from moelab.contract.status import RunStatus
from moelab.launch.executor import Executor
from moelab.launch.executors import EXECUTORS, register_executor, unregister_executor
from moelab.launch.jobs import Job


class ThreadJob(Job):
    """A run training in a thread of this process: RUNNING while the thread lives, then the stream's end."""

    executor = "thread"

    def state(self) -> RunStatus:
        if self.handle is not None and self.handle.is_alive():
            return RunStatus.RUNNING
        return self.stream_state()


class ThreadExecutor(Executor):
    """One rank in a background thread of this process; takes one option, `label`, recorded in run.json."""

    name, job_class, options = "thread", ThreadJob, ("label",)

    def submit(self, folders, nproc, options, submitit_folder, world):
        from moelab.launch.entry import train_rank

        jobs = []
        for folder in folders:
            info = {"name": folder.name, "executor": self.name, "created": time.time(), "ntasks": world,
                    "options": dict(options)}
            folder.write_info(info)
            thread = threading.Thread(target=train_rank, args=(folder.path,), daemon=True)
            thread.start()
            jobs.append(self.job(folder, info, thread))
        return jobs


@pytest.fixture
def thread_executor():
    executor = register_executor(ThreadExecutor())  # the one registration
    yield executor
    unregister_executor(executor.name)


def test_a_registered_executor_runs_a_session_and_its_run_follows_it(tmp_path, small_session, thread_executor):
    run = small_session(train={"steps": 2}).submit("thread", folder=tmp_path / "a", label="first")
    assert run.executor == "thread" and run.in_background and isinstance(run.job, ThreadJob)
    assert run.wait(timeout=300).status == "COMPLETED"
    assert list(run.metrics["step"]) == [1, 2] and run.summary["status"] == "COMPLETED"
    again = Run.load(tmp_path / "a")  # another kernel: the Job from the registry, by run.json's name
    assert isinstance(again.job, ThreadJob) and again.status == "COMPLETED"
    assert again.run_folder.read_info()["options"] == {"label": "first"}
    longer = again.resume(steps=3)  # back to its executor with its options
    assert longer.wait(timeout=300).status == "COMPLETED" and list(longer.metrics["step"]) == [1, 2, 3]


def test_its_options_are_checked_before_anything_is_written(tmp_path, small_session, thread_executor):
    with pytest.raises(ConfigError, match=r"cluster option\(s\) \['lable'\] are unknown for executor='thread'; "
                                          r"valid thread options: label"):
        small_session().submit("thread", folder=tmp_path / "b", lable="x")
    assert not (tmp_path / "b").exists()


def test_the_command_line_offers_it(tmp_path, capsys, thread_executor):
    code = main(["run", "tiny", "--executor", "thread", "--steps", "1", "--out", str(tmp_path / "c"),
                 "--set", "model.num_layers=1", "--set", "train.seq_len=16", "--set", "train.device=cpu",
                 "--set", "train.global_batch_size=2", "--set", "train.micro_batch_size=2",
                 "--set", "train.warmup_steps=1"])
    assert code == 0, capsys.readouterr().err
    assert "submitted c: executor thread" in capsys.readouterr().out


def test_the_built_in_names_stay():
    for name in ("inline", "local", "slurm", "auto"):
        with pytest.raises(ValueError, match="built in"):
            register_executor(type("Mine", (ThreadExecutor,), {"name": name})())
    with pytest.raises(ValueError, match="built in"):
        unregister_executor("local")
    assert list(EXECUTORS) == ["inline", "local", "slurm"]
