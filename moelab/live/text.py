"""The terminal view: the dashboard outside a notebook.

On a terminal one run is a single line rewritten in place (`\\r`); in a log (not a TTY), or for several runs, a
line per run every `every_s` seconds and whenever a status changes. Warnings, corrupt lines and errors are
printed once each, on their own lines.

    view = TextView(sys.stdout)
    view.update([state], final=True)
"""
from __future__ import annotations

import sys
import threading
import time

from moelab.live.state import DashState


class TextView:
    def __init__(self, stream=None, every_s: float = 5.0):
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s
        self.lock = threading.RLock()  # the monitor's thread and wait() take turns
        self._printed_at = 0.0
        self._statuses: list = []
        self._lines: list = []  # the status lines printed last
        self._seen: list = []  # per run: (warnings, corrupt, errors) already printed
        self._width = 0  # of the `\r` line on screen, to blank out a longer previous one

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _notes(self, i: int, st: DashState) -> list[str]:
        """New warning / corrupt-line / error lines of run i since the last call."""
        w0, c0, e0 = self._seen[i]
        self._seen[i] = (len(st.warnings), len(st.corrupt), len(st.errors))
        name = st.name or "run"
        out = [f"{name}: warning at step {'?' if e.step is None else e.step}: {e.kind}: {e.message}"
               for e in st.warnings[w0:]]
        out += [f"{name}: skipped a corrupt metrics line: {m}" for m in st.corrupt[c0:]]
        out += [f"{name}: error on rank {'?' if e.rank is None else e.rank} at step "
                f"{'?' if e.step is None else e.step}: {e.message}" for e in st.errors[e0:]]
        return out

    def update(self, states: list, final: bool = False) -> None:
        if not self._seen:
            self._seen = [(0, 0, 0)] * len(states)
        notes = [line for i, st in enumerate(states) for line in self._notes(i, st)]
        statuses = [st.status for st in states]
        changed, self._statuses = statuses != self._statuses, statuses
        if self.tty and len(states) == 1:
            line = states[0].status_line()
            if final and [line] == self._lines and not notes:
                return
            self._lines = [line]
            if notes:  # a note takes the line, the status is redrawn below it
                self._write("\r" + " " * self._width + "\r" + "\n".join(notes) + "\n")
                self._width = 0
            self._write("\r" + line.ljust(self._width) + ("\n" if final else ""))
            self._width = 0 if final else len(line)
            return
        for note in notes:
            self._write(note + "\n")
        now = time.monotonic()
        lines = [st.status_line() for st in states]
        if (final and lines != self._lines) or changed or now - self._printed_at >= self.every_s:
            for line in lines:
                self._write(line + "\n")
            self._printed_at, self._lines = now, lines

    def resync(self, final: bool = False) -> None:
        """Nothing to re-send: a terminal already has every line."""
