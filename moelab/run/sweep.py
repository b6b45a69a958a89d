"""A Sweep: the runs of one Session.sweep(), and `runs()`: every run under a folder.

    sweep = Sweep.load("runs/tiny-sweep-20261130-101500")   # from sweep.json, in any kernel
    sweep.status                                           # one status per run
    runs("runs")                                           # every run folder under runs/, oldest first
"""
from __future__ import annotations

import time
from pathlib import Path

from moelab.contract.folder import INFO, METRICS, SWEEP, RunFolder, read_json
from moelab.run.run import Run


class Sweep(list):
    """The runs of one Session.sweep(): a list of Runs with group operations.

        sweep = Session("tiny").sweep({"model.moe.aux_loss_coeff": [0, 1e-3, 1e-2]}, executor="slurm")
        sweep.wait().status      # ['COMPLETED', 'COMPLETED', 'COMPLETED']
        sweep.compare()
    """

    def __init__(self, runs=(), folder: "str | Path | None" = None):
        super().__init__(runs)
        self.folder = Path(folder) if folder is not None else None

    @classmethod
    def load(cls, folder: "str | Path") -> "Sweep":
        """The Sweep of a sweep folder (its sweep.json names the runs); FileNotFoundError for another folder."""
        folder = Path(folder)
        info = read_json(RunFolder(folder).sweep_path)
        if info is None:
            raise FileNotFoundError(f"{folder} is not a sweep folder (no {SWEEP})")
        return cls([Run.load(folder / r) for r in info["runs"]], folder)

    @classmethod
    def fork(cls, parent: Run, grid: dict, step: int | None = None, folder: "str | Path | None" = None,
             executor: str | None = None, nproc: int | None = None, **cluster_options) -> "Sweep":
        """Forks of `parent` from its checkpoint at `step` (default the newest), one per point of `grid`
        (moelab.run.fork.fork_points); compare() and the dashboard's tabs show them side by side.

            forks = Sweep.fork(run, {"model.moe.aux_loss_coeff": [1e-3, 1e-2]}, step=20).wait()
        """
        from moelab.run.fork import fork_points

        root, jobs = fork_points(parent, grid, step, folder, executor, nproc, **cluster_options)
        return cls([Run(j.folder.path, j.info, j) for j in jobs], root)

    @property
    def status(self) -> list[str]:
        """Every run's status, in order."""
        return [r.status for r in self]

    @property
    def done(self) -> bool:
        """Have all runs ended?"""
        return all(r.done for r in self)

    @property
    def job_ids(self) -> list[str | None]:
        """Every run's job id, in order."""
        return [r.job_id for r in self]

    def wait(self, timeout: float | None = None) -> "Sweep":
        """Wait for every run to end (within `timeout` seconds in all); returns self."""
        end = None if timeout is None else time.monotonic() + timeout
        for r in self:
            r.wait(None if end is None else max(0.0, end - time.monotonic()))
        return self

    def cancel(self) -> None:
        """Cancel every run."""
        for r in self:
            r.cancel()

    def dashboard(self):
        """The live dashboard of all runs, one tab each (moelab.live)."""
        from moelab.live import dashboard

        return dashboard(self)

    def compare(self):
        """The runs side by side: curves, balance and final figures (moelab.live.compare)."""
        from moelab.live.compare import compare

        return compare(self)

    def __repr__(self) -> str:
        where = f" in {str(self.folder)!r}" if self.folder else ""
        return f"Sweep({len(self)} runs{where}: " + ", ".join(f"{r.name}: {r.status}" for r in self) + ")"


class RunList(list):
    """What moelab.runs() returns: a list of Runs that shows itself as a table, one row per run.

        rs = moelab.runs("runs")
        rs.table        # a pandas DataFrame: name, status, step, total_steps, loss, executor, job_id, folder
        rs[-1].wait()   # still a list of Runs
    """

    @property
    def table(self):
        """One row per run (name, progress, executor, job id, folder): a pandas DataFrame where pandas is installed,
        else a list of dicts."""
        rows = [{"name": r.name, **r.progress(), "executor": r.executor, "job_id": r.job_id, "folder": str(r.folder)}
                for r in self]
        try:
            import pandas as pd
        except ImportError:
            return rows
        return pd.DataFrame(rows, columns=["name", "status", "step", "total_steps", "loss", "tokens_per_s",
                                           "executor", "job_id", "folder"])

    def __repr__(self) -> str:
        table = self.table
        return table.to_string(index=False) if hasattr(table, "to_string") and self else repr(list(self))

    def _repr_html_(self) -> str:
        table = self.table
        return table.to_html(index=False) if hasattr(table, "to_html") else f"<pre>{self!r}</pre>"


def runs(root: "str | Path" = "runs") -> RunList:
    """Every run folder under `root` (sweeps included), oldest first, as a RunList (a table in Jupyter)."""
    root = Path(root)
    if not root.is_dir():
        return RunList()
    found = {p.parent for name in (INFO, METRICS)
             for p in list(root.glob(f"*/{name}")) + list(root.glob(f"*/*/{name}")) + list(root.glob(name))}
    return RunList(Run(f) for f in sorted(found, key=lambda f: (RunFolder(f).created(), str(f))))
