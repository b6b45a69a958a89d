"""Stop signals: SIGTERM, SIGUSR1 and submitit's preemption signal (SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL says
otherwise) become a flag that the training loop reads at the next step boundary, never an exception in the
middle of a step. The loop then saves a checkpoint, ends the run with status PREEMPTED, and hands each signal to
the handler that was installed before (submitit's, which requeues the job), so requeueing sees a finished
checkpoint. Before the loop starts (`deferring` False: setup, loading a checkpoint) there is nothing new to save,
so a signal goes straight to the previous handler, or gets its default action: a slow setup never outlives the
time SLURM grants between the signal and the kill (submitit's signal_delay_s).

Ctrl-C (SIGINT) is a stop request too once the loop runs: an inline run checkpoints at the step boundary and ends
CANCELLED (`interrupted`). A second signal while the run is stopping gets at once what it would have got
without us (SIGTERM's default action ends the process, exit status 143, after the trainer wrote the attempt's
end event: StopNow; a second Ctrl-C raises KeyboardInterrupt, which a notebook kernel survives), even inside a step
that would take hours to reach its boundary (a huge batch); the last complete checkpoint stays as it was (a save
is atomic).

    stop = StopSignals().install()   # in the main thread; a no-op elsewhere (a notebook's worker thread)
    stop.deferring = True            # when the step loop starts
    ... if stop.requested: save, end the loop ...
    stop.restore(); stop.chain()     # after the run's last event is written
"""
from __future__ import annotations

import os
import signal
import threading


class StopSignals:
    """SIGTERM / SIGUSR1 / submitit's preemption signal / SIGINT, turned into a stop at the next step boundary.

        stop = StopSignals(); stop.install()
        ...; stop.requested                 # True once a signal came; the trainer checkpoints and stops
        stop.restore()
    """
    def __init__(self):
        names = ["SIGTERM", "SIGUSR1", "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), "SIGINT"]
        self.signals = [getattr(signal, n) for n in dict.fromkeys(names) if hasattr(signal, n)]
        self.received: list[int] = []
        self._previous: dict[int, object] = {}  # while installed
        self._chain_to: dict[int, object] = {}  # after restore(): the handlers chain() calls
        self.deferring = False

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                if s == signal.SIGINT and signal.getsignal(s) == signal.SIG_IGN:
                    continue  # a process started to ignore Ctrl-C (a background job) keeps ignoring it
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if not self.deferring:
            _pass_on(signum, self._previous.get(signum), frame)
        elif self.received:  # stopping already: what the signal would have done without us, now
            previous = self._previous.get(signum)
            if not callable(previous) and previous != signal.SIG_IGN:
                raise StopNow(signum)  # the trainer writes the end event, then act_now: the default action
            _pass_on(signum, previous, frame)
        else:
            self.received.append(signum)

    @property
    def requested(self) -> bool:
        return bool(self.received)

    @property
    def interrupted(self) -> bool:
        """A Ctrl-C (SIGINT) asked for the stop: the run ends CANCELLED rather than PREEMPTED."""
        return signal.SIGINT in self.received

    @property
    def names(self) -> list[str]:
        return [signal.Signals(s).name for s in dict.fromkeys(self.received)]

    def restore(self) -> None:
        """Put back the handlers that were there before install()."""
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._chain_to, self._previous = self._previous, {}

    def act_now(self, signum: int) -> None:
        """After restore(): what `signum` would have done without us (the default action ends the process, with
        the exit status of that signal: 143 for SIGTERM); exits with 128 + signum should the process survive it."""
        _pass_on(signum, self._chain_to.get(signum), None)
        raise SystemExit(128 + signum)

    def chain(self) -> None:
        """Give each received signal to the handler installed before ours, if that was a Python function
        (submitit's checkpoint-and-requeue handler, which may exit the process)."""
        for s in dict.fromkeys(self.received):
            previous = self._chain_to.get(s)
            if callable(previous) and s != signal.SIGINT:  # Python's SIGINT handler would raise KeyboardInterrupt
                previous(s, None)


class StopNow(BaseException):
    """A second stop signal while the run stops, whose default action ends the process (SIGTERM, SIGUSR1 without a
    handler of its own): raised in the middle of a step so that the trainer writes the attempt's end event (no
    checkpoint at this step: the last complete one stays) before StopSignals.act_now ends the process.

        except StopNow as e: writer.emit(EndEvent(...)); stop.restore(); stop.act_now(e.signum)
    """

    def __init__(self, signum: int):
        super().__init__(f"a second {signal.Signals(signum).name} while the run stopped")
        self.signum = signum


def _pass_on(signum: int, previous, frame) -> None:
    """What would have happened without us: the previous Python handler, or the default action."""
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
