"""Widget callbacks while a cell blocks, in a real ipykernel driven by jupyter_client as a frontend would: the
dashboard's Cancel button is clicked (a comm message on the shell channel) while another cell sits in a wait,
and the click must reach the run before that cell ends."""
from __future__ import annotations

import json
import os
import queue
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

SETUP = """
import json, pathlib, threading, time
from moelab.live import dashboard

class FakeRun:  # a run folder that never ends until cancelled; cancel() records the thread it ran on
    def __init__(self, folder):
        self.folder, self.name, self.status, self.cancelled = folder, "blocked", "RUNNING", threading.Event()
    def cancel(self):
        self.status, self.cancel_thread = "CANCELLED", threading.current_thread().name
        self.cancelled.set()

folder = pathlib.Path({folder!r}); folder.mkdir()
step = {{"event": "step", "time": 2.0, "step": 1, "loss": 1.0,
         "routing": {{"routed_per_expert": [[1, 2], [3, 3]], "dropped_tokens": [0, 0]}}}}
(folder / "metrics.jsonl").write_text(json.dumps({{"event": "start", "time": 1.0, "total_steps": 10}}) + "\\n"
                                      + json.dumps(step) + "\\n")
run = FakeRun(folder)
dash = dashboard(run)
panel = dash.widget_view.panels[0]
print(json.dumps({{"cancel": panel.cancel_button.model_id, "layer": panel.layer.model_id,
                  "routed": dash.widget_view.answered_while_busy}}))
"""
# The blocking cell: waits for the click as run.wait() waits for a run (a sleeping loop on the main thread).
BLOCK = """
while not panel.layer.options:  # the monitor thread fills the layer selector from the first step
    time.sleep(0.05)
print("blocking at layer", panel.layer.value, flush=True)
for _ in range(600):
    if run.cancelled.is_set() and panel.layer.value == 1:
        break
    time.sleep(0.1)
print("cancelled while blocked" if run.cancelled.is_set() else "not cancelled", run.__dict__.get("cancel_thread"))
print("layer", panel.layer.value, "while blocked")
"""


def _outputs(kc, msg_id: str, until: str | None = None, timeout: float = 120) -> str:
    """The stream text of one execution, read until its idle status (or until `until` appears)."""
    text = ""
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no output from the kernel for {timeout} s; so far: {text!r}")
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text += msg["content"]["text"]
        elif msg["msg_type"] == "error":
            pytest.fail("\n".join(msg["content"]["traceback"]))
        if until is not None and until in text:
            return text
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return text


def test_cancel_and_the_layer_selector_act_while_a_cell_blocks(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("MOELAB_UI", None)
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path))
    try:
        out = _outputs(kc, kc.execute(SETUP.format(folder=str(tmp_path / "run"))))
        ids = json.loads(out.strip().splitlines()[-1])
        assert ids["routed"], "this kernel did not accept the dashboard's subshell"
        block = kc.execute(BLOCK)
        assert "blocking at layer 0" in _outputs(kc, block, until="blocking")  # layer 0: the less balanced
        # what a browser sends when a layer is picked and when the button is clicked (ipywidgets' messages)
        send = lambda comm, data: kc.session.send(kc.shell_channel.socket, kc.session.msg(
            "comm_msg", {"comm_id": comm, "data": data}))
        send(ids["layer"], {"method": "update", "state": {"index": 1}, "buffer_paths": []})
        send(ids["cancel"], {"method": "custom", "content": {"event": "click"}})
        out = _outputs(kc, block)
        assert "cancelled while blocked" in out and "subshell" in out, out
        assert "layer 1 while blocked" in out, out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_config_error_in_a_notebook_is_its_message_without_the_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path))
    try:
        msg_id = kc.execute("from moelab import Session\nSession('tiny', train={'steps': 0})", stop_on_error=False)
        while True:
            msg = kc.get_iopub_msg(timeout=120)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "error":
                break
        assert msg["content"]["ename"] == "ConfigError"
        shown = msg["content"]["traceback"]
        assert len(shown) == 2 and "ConfigError\x1b[0m: train.steps=0: must be >= 1" in shown[0], shown
        assert "raised in " in shown[1] and "config/rules.py" in shown[1]
        tb_text: list = []
        tb = kc.execute_interactive("import sys, traceback; traceback.print_exception(sys.last_value)",
                                    timeout=120, output_hook=lambda m: tb_text.append(m["content"]))
        assert tb["content"]["status"] == "ok"
        assert any("Traceback" in str(c) for c in tb_text), tb_text  # the full traceback is still one command away
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
