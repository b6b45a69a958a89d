"""Widget callbacks that answer while a cell blocks: the dashboard's comm messages go to a kernel subshell.

A Jupyter kernel handles a frontend's widget messages (a click on Cancel, a new layer in a dropdown) on the
thread that runs cells, so while `run.wait()` blocks a cell they queue until it ends. jupyter-ui-poll's answer
(calling `kernel.do_one_iteration()` from the blocking loop) no longer exists in ipykernel 7: the kernel reads
the shell socket on its own "shell channel" thread and hands each message to the main thread or to a subshell
(JEP 91), each with its own event loop. ipykernel 7.4 asks a comm where its messages go
(`comm._reply_subshell_for(data, default)` -> subshell id). So this module creates one subshell per kernel
(through the control thread, as a frontend's `create_subshell_request` would) and routes the dashboard's widget
comms to it: their callbacks then run on the subshell's thread, whatever the main thread is doing. The
callbacks must be thread-safe (the dashboard's take the view's lock).

    from moelab.live.kernel import answer_while_busy
    answer_while_busy([button, dropdown])   # True where the kernel supports it (ipykernel >= 7.4)

Elsewhere (ipykernel 6, a terminal) it returns False and callbacks run when the kernel is idle, as before.
"""
from __future__ import annotations

import sys
import threading

_ATTR = "_moelab_subshell_id"  # kept on the kernel object: one subshell per kernel, however often cells re-run


def current_kernel():
    """The ipykernel Kernel running this code, or None (a terminal, a plain IPython shell)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None)


def subshell(kernel, timeout_s: float = 10.0) -> "str | None":
    """The id of this kernel's moelab subshell, created on first use; None where subshells are unsupported."""
    sid = getattr(kernel, _ATTR, None)
    if sid:
        return sid
    channel, control = getattr(kernel, "shell_channel_thread", None), getattr(kernel, "control_thread", None)
    manager = getattr(channel, "manager", None)
    pair = getattr(manager, "control_to_shell_channel", None)
    if pair is None or control is None or not hasattr(control, "io_loop"):
        return None
    reply: dict = {}
    done = threading.Event()

    def create() -> None:  # on the control thread, the only user of this socket (kernelbase does the same)
        try:
            pair.from_socket.send_json({"type": "create"})
            reply.update(pair.from_socket.recv_json())
        except Exception as e:  # reported as no subshell: the widgets then answer when the kernel is idle
            reply.update(status="error", evalue=repr(e))
        finally:
            done.set()

    control.io_loop.add_callback(create)
    if not done.wait(timeout_s) or reply.get("status") != "ok":
        return None
    setattr(kernel, _ATTR, reply["subshell_id"])
    return reply["subshell_id"]


def answer_while_busy(widgets: list) -> bool:
    """Route the frontend messages of `widgets` to this kernel's moelab subshell, so that their callbacks run
    while a cell blocks. Returns False (and changes nothing) where the kernel cannot do it."""
    comms = [getattr(x, "comm", None) for x in widgets]
    if not comms or not all(c is not None and hasattr(c, "_reply_subshell_for") for c in comms):
        return False
    kernel = current_kernel()
    sid = subshell(kernel) if kernel is not None else None
    if sid is None:
        return False
    for comm in comms:  # an instance attribute shadows the method the shell channel thread calls
        comm._reply_subshell_for = lambda data, default, _sid=sid: _sid
    return True
