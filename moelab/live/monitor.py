"""The live driver: a daemon thread tails each run's metrics.jsonl, folds events into `DashState`s and hands
them to a view (widgets in a notebook, text elsewhere).

Why a thread (verified in JupyterLab 4, ipykernel 6 and 7): it keeps updating while another cell blocks
(`run.wait()`), where an asyncio task on the kernel loop freezes. In a notebook the thread only assigns widget
values and never prints (a print from a thread lands in whatever cell is running); elsewhere it prints the
text view's lines.

    dash = dashboard(run)      # returns at once; the view follows the run
    dash.wait()                # blocks until the run ends; re-sends the final widget state

A run here is duck-typed: anything with `.folder` (and optionally `.name`, `.status`, `.error`, `.cancel()`),
or a run folder path; a sweep is an iterable of runs (optionally with `.cancel()`).
"""
from __future__ import annotations

import os
import sys
import threading
import time

from moelab.live.state import DashState, is_terminal, run_folder
from moelab.contract.folder import RunFolder
from moelab.contract.stream import JsonlTail


def in_notebook() -> bool:
    """True in a Jupyter kernel (Lab, Notebook, VS Code, nbclient). MOELAB_UI=text|widget overrides."""
    forced = os.environ.get("MOELAB_UI")
    if forced:
        return forced == "widget"
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None  # a kernel's shell (subclasses too, e.g. Colab's)


def _value(obj, attr: str):
    """`run.status` may be a property or a method; either way return the value (None when absent)."""
    v = getattr(obj, attr, None)
    return v() if callable(v) else v


class Target:
    """One followed run: its tail of metrics.jsonl, its state, and what the Run object says."""

    def __init__(self, run):
        self.run = run
        self.path = RunFolder(run_folder(run)).metrics
        self.state = DashState(name=str(getattr(run, "name", "") or self.path.parent.name))
        self.tail = JsonlTail(self.path, typed=True)
        self.has_status = hasattr(run, "status")
        self._inode = None

    def poll(self) -> None:
        try:
            inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            inode = None
        if self._inode is not None and inode is not None and inode != self._inode:
            # A resumed run rewrites its stream once (temp file + rename, without the steps it will redo):
            # read the new file from its start into a fresh state.
            old = self.state
            self.state = DashState(name=old.name, run_status=old.run_status, run_error=old.run_error,
                                   version=old.version + 1)
            self.tail = JsonlTail(self.path, typed=True)
        self._inode = inode if inode is not None else self._inode
        while events := self.tail.poll():  # in bounded chunks, until caught up
            for event in events:
                self.state.apply(event)
        self.state.set_corrupt(self.tail.errors)

    def refresh_status(self) -> None:
        if not self.has_status:
            return
        try:
            status = _value(self.run, "status")
            error = _value(self.run, "error") if is_terminal(status) else None
            if status == "PENDING":  # why the scheduler holds it (a SLURM job), shown in the status line
                error = _value(self.run, "pending_reason")
        except Exception as e:  # a status query that fails (scheduler down) is shown, not fatal
            status, error = self.state.run_status, f"status unavailable: {e}"
        self.state.set_run(status, error)

    @property
    def cancel(self):
        return getattr(self.run, "cancel", None)


class Monitor:
    """Polls every `period` seconds (the Run's status every `status_every` seconds: it may ask a scheduler)
    until every run reached a terminal status, then draws the final state once more."""

    def __init__(self, targets: list, view, period: float = 0.25, status_every: float = 1.0):
        self.targets, self.view = targets, view
        self.period, self.status_every = period, status_every
        self.error: BaseException | None = None
        self._lock = view.lock  # the thread, wait() and the view's callbacks take turns on the states
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._status_at = 0.0
        self._thread = threading.Thread(target=self._loop, name="moelab-dashboard", daemon=True)

    @property
    def states(self) -> list:
        return [t.state for t in self.targets]

    def done(self) -> bool:
        return all(t.state.done for t in self.targets)

    def poll_once(self, final: bool = False) -> bool:
        """Read new events, refresh statuses when due, update the view. Returns True when every run is done."""
        with self._lock:
            now = time.monotonic()
            if final or now - self._status_at >= self.status_every:
                for t in self.targets:
                    t.refresh_status()
                self._status_at = now
            for t in self.targets:  # after the status: a run that just ended has written its last lines
                t.poll()
            self.view.update(self.states, final=final)
            return self.done()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self.poll_once():
                    break
                self._stop.wait(self.period)
            self.poll_once(final=True)
        except BaseException as e:  # kept for wait(), which raises it: a thread must not die silently
            self.error = e
        finally:
            self._finished.set()

    def start(self) -> "Monitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout: "float | None" = None) -> bool:
        """Block until every run ended (or `timeout` seconds); then, from this thread, read and draw the final
        state and re-send it (headless executors only record messages sent while a cell runs)."""
        finished = self._finished.wait(timeout)
        if self.error is not None:
            raise RuntimeError(f"the dashboard stopped: {self.error!r}") from self.error
        done = self.poll_once(final=finished)
        self.view.resync(final=done)
        return done


class Dashboard:
    """What `dashboard()` returns: the live view of a run or sweep.

    dash.state / dash.states   the folded metrics (DashState)
    dash.wait(timeout=None)    block until the runs end; True when they all did
    dash.stop()                stop following (the runs go on)
    """

    def __init__(self, monitor: Monitor, widget_view=None):
        self.monitor, self.widget_view = monitor, widget_view
        self._shown_in = None  # the cell that displayed the widget, so that it is not displayed twice there

    @property
    def states(self) -> list:
        return self.monitor.states

    @property
    def state(self) -> DashState:
        return self.monitor.states[0]

    def wait(self, timeout: "float | None" = None) -> bool:
        return self.monitor.wait(timeout)

    def stop(self) -> None:
        self.monitor.stop()

    def show(self) -> None:
        self.widget_view.display()
        self._shown_in = _execution_count()

    def _ipython_display_(self) -> None:
        if self.widget_view is None:
            print(repr(self))
        elif self._shown_in != _execution_count():  # `dash` evaluated again in a later cell
            self.show()

    def __repr__(self) -> str:
        return "\n".join(st.status_line() for st in self.states)


def _execution_count():
    from IPython import get_ipython

    shell = get_ipython()
    return getattr(shell, "execution_count", None)


def _runs(run_or_sweep) -> list:
    if isinstance(run_or_sweep, (str, os.PathLike)) or not hasattr(run_or_sweep, "__iter__"):
        return [run_or_sweep]  # a Run or a folder (a Sweep has a folder too, but it is a list of Runs)
    runs = list(run_or_sweep)
    if not runs:
        from moelab.config import ConfigError

        raise ConfigError("dashboard() got an empty sweep; pass a Run, a Sweep with runs, or a run folder")
    return runs


def dashboard(run_or_sweep, period: float = 0.25, stream=None) -> Dashboard:
    """Follow a Run, a Sweep (a list of Runs) or a run folder live, without blocking.

    In a notebook it displays a widget (progress, stats, charts, a layer selector, Cancel); elsewhere it prints
    a progress line to `stream` (stdout). Returns a `Dashboard`; `dash.wait()` blocks until the runs end.

        run = Session("tiny").submit()
        dash = run.dashboard()     # Run.dashboard() calls this
        dash.wait()
    """
    runs = _runs(run_or_sweep)
    targets = [Target(r) for r in runs]
    widget_view = None
    if in_notebook() and stream is None:
        from moelab.live.widget import WidgetView

        cancel_all = getattr(run_or_sweep, "cancel", None) if run_or_sweep is not runs[0] else None
        if cancel_all is None and all(t.cancel for t in targets):
            cancel_all = lambda: [t.cancel() for t in targets]
        view = widget_view = WidgetView([t.state.name for t in targets], [t.cancel for t in targets], cancel_all,
                                        runs=[t.run for t in targets])
    else:
        from moelab.live.text import TextView

        view = TextView(stream)
    dash = Dashboard(Monitor(targets, view, period), widget_view)
    if widget_view is not None:
        dash.show()
    dash.monitor.start()
    return dash
