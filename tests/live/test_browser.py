"""The notebooks in a real browser: JupyterLab on 127.0.0.1, Debian's Chromium driven by Playwright
(Playwright's own browser download does not work offline; /usr/bin/chromium comes from `apt-get install
chromium`).

- The quickstart: run all cells, then watch the DOM: the dashboard renders, its progress bar and chart change
  while the kernel is busy, it ends complete with the load-over-steps heatmap, and the notebook, saved and
  reopened without its kernel, shows the static snapshot. Screenshots go to tmp_path; with
  MOELAB_UPDATE_SCREENSHOT=1 they are also copied to gallery/dashboard.png (mid-run) and
  gallery/dashboard-done.png (final).
- Cancel clicked while the next cell blocks in `run.wait()` stops the run (local executor and the local SLURM
  cluster); the seconds from submit to the first live metric are printed (not asserted: a loaded machine).
- A kernel restart leaves a local run training (its controller runs in a session of its own): a new cell's
  `Run.load(folder)` reattaches, and its dashboard follows the step count as it grows.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROME_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
               "--disable-background-networking", "--disable-component-update", "--disable-dev-shm-usage"]
TOKEN = "moelab-browser-test"
# Long enough (about 15 s on two idle cores) that the half-way screenshot and several live chart updates are
# caught by the 0.5 s polling below, however fast the machine.
STEPS = 300

# What the page shows, read in one evaluate: the dashboard is the first widget box of the notebook.
PROBE = """() => {
  const outs = [...document.querySelectorAll('.jp-OutputArea-output')];
  const bar = document.querySelector('.jp-OutputArea-output .progress .progress-bar');
  return {
    loading: outs.filter(e => /Loading widget/.test(e.textContent)).length,
    bar: bar ? bar.style.width : null,
    imgs: [...document.querySelectorAll('img.widget-image')].map(i => i.src + ' ' + i.naturalWidth),
    html: [...document.querySelectorAll('.widget-html-content')].map(e => e.textContent.trim()),
    errs: [...document.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
          .map(e => e.textContent.slice(0, 300)),
  };
}"""
# Busy = a cell is queued or running ([*]) or the kernel says so. The kernel's status alone is not enough: under
# load JupyterLab was seen showing "idle" while run.wait() ran (status messages arriving out of order).
RUNNING_CELLS = """() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
  .filter(e => e.textContent.includes('[*]')).length"""
KERNEL = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return k ? k.status : 'none';
}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(port: int, path: str, method: str = "GET"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/{path}?token={TOKEN}", method=method,
                                 data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    return json.loads(body) if body else None


@pytest.fixture
def lab(tmp_path):
    """An isolated JupyterLab (fresh settings, workspaces and runtime dirs; token on; 127.0.0.1 only) serving a
    copy of the quickstart notebook (a test may write more notebooks into its root); the kernel inherits the
    environment, so runs go under tmp_path."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (tests/setup_machine.sh does it)")
    root, state = tmp_path / "lab", tmp_path / "lab-state"
    root.mkdir()
    shutil.copy(REPO / "notebooks" / "01_quickstart.ipynb", root)
    settings = state / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(state / "settings"), "MOELAB_NOTEBOOK_STEPS": str(STEPS),
           "JUPYTERLAB_WORKSPACES_DIR": str(state / "workspaces"), "JUPYTER_RUNTIME_DIR": str(state / "runtime"),
           "OMP_NUM_THREADS": "1"}
    env.pop("MOELAB_NOTEBOOK_SCALE", None)
    env.pop("MOELAB_UI", None)
    port = _free_port()
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip", "127.0.0.1",
         f"--port={port}", f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={root}",
         "--LabApp.expose_app_in_browser=True"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                _api(port, "status")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start:\n{(tmp_path / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.2)
        yield port, root
    finally:
        try:  # the kernel (and its dashboard thread) outlives the page: shut it down through the server
            for k in _api(port, "kernels"):
                _api(port, f"kernels/{k['id']}", "DELETE")
        except OSError:
            pass
        proc.terminate()  # our own server, by its Popen handle
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _run_all(p, tmp_path: Path, port: int, name: str):
    """Chromium on the notebook, its kernel idle, then run-all; returns (browser context, page)."""
    ctx = p.chromium.launch_persistent_context(str(tmp_path / "chrome"), executable_path=CHROMIUM, headless=True,
                                               args=CHROME_ARGS, viewport={"width": 1280, "height": 1800})  # all of it
    try:
        page = ctx.pages[0] if ctx.pages else ctx.new_page()
        page.goto(f"http://127.0.0.1:{port}/lab/tree/{name}?token={TOKEN}&reset", wait_until="domcontentloaded")
        page.wait_for_function(f"() => ({KERNEL})() === 'idle'", timeout=90_000)
        # run-all returns a promise that settles when every cell finished: do not wait for it here
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); return 1; }")
    except BaseException:
        ctx.close()
        raise
    return ctx, page


def test_quickstart_dashboard_is_live_in_jupyterlab(lab, tmp_path):
    from playwright.sync_api import sync_playwright

    port, root = lab
    timeline, shots = [], {}
    with sync_playwright() as p:
        ctx, page = _run_all(p, tmp_path, port, "01_quickstart.ipynb")
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 600:
                time.sleep(0.5)
                kernel, running, dom = page.evaluate(KERNEL), page.evaluate(RUNNING_CELLS), page.evaluate(PROBE)
                busy = kernel == "busy" or running > 0
                timeline.append({"t": round(time.monotonic() - t0, 1), "kernel": kernel, "running": running,
                                 "busy": busy, **dom})
                pct = float((dom["bar"] or "0%").rstrip("%"))
                if "live" not in shots and 50 <= pct <= 90 and len(dom["imgs"]) >= 2:
                    shots["live"] = _shoot(page, tmp_path / "dashboard.png")
                if not busy and any("COMPLETED" in h for h in dom["html"]):
                    break
            time.sleep(1.0)
            final = page.evaluate(PROBE)
            shots["done"] = _shoot(page, tmp_path / "dashboard-done.png")
            page.screenshot(path=str(tmp_path / "page.png"))
            heatmap = page.evaluate(ROUTING_ASPECT)
            live_snapshot = page.evaluate(SNAPSHOT)
            reopened = _reopen(page, port, "01_quickstart.ipynb", tmp_path / "reopened.png")
        finally:
            ctx.close()
    (tmp_path / "timeline.json").write_text(json.dumps(timeline, indent=1))

    busy = [e for e in timeline if e["busy"]]
    bars = {e["bar"] for e in busy if e["bar"]}
    charts = {e["imgs"][0] for e in busy if e["imgs"]}
    assert not any(e["loading"] for e in timeline), "a widget showed 'Loading widget...'"
    assert len(bars) >= 3, f"the progress bar did not move while the kernel was busy: {sorted(bars)}"
    assert len(charts) >= 3, f"the chart changed only {len(charts)} time(s) while the kernel was busy"
    assert final["bar"] == "100%" and any("COMPLETED" in h for h in final["html"]), final
    assert any(f"{STEPS} / {STEPS} steps" in h for h in final["html"]), final["html"]
    assert not final["errs"], final["errs"]
    assert "live" in shots, "no screenshot while the run was between 50% and 90%"
    # the routing chart has the load-over-steps heatmap as a third panel under the other two (a 12 x 5 inch
    # figure; without it 10 x 2.4)
    assert heatmap > 0.35, f"the routing chart's height / width is {heatmap}: no load-over-steps heatmap"
    # the snapshot is in the output, hidden while the live widget renders; reopened without widget state it shows
    assert live_snapshot == {"count": 1, "visible": 0, "images": 2}, live_snapshot
    assert reopened["count"] == 1 and reopened["visible"] == 1 and reopened["images"] == 2, reopened
    if os.environ.get("MOELAB_UPDATE_SCREENSHOT") == "1":
        shutil.copy(shots["live"], REPO / "gallery" / "dashboard.png")
        shutil.copy(shots["done"], REPO / "gallery" / "dashboard-done.png")
        shutil.copy(tmp_path / "reopened.png", REPO / "gallery" / "dashboard-snapshot.png")


ROUTING_ASPECT = """() => {
  const i = document.querySelector('img.widget-image.moelab-routing');
  return i && i.naturalWidth > 0 ? i.naturalHeight / i.naturalWidth : 0;
}"""
# The static snapshot left by dash.wait(): how many, how many visible, how many loaded images in it.
SNAPSHOT = """() => {
  const snaps = [...document.querySelectorAll('.moelab-snapshot')];
  return {count: snaps.length, visible: snaps.filter(e => e.offsetParent !== null).length,
          images: snaps.flatMap(e => [...e.querySelectorAll('img')]).filter(i => i.naturalWidth > 0).length};
}"""


SCROLL_TO_DASHBOARD = """async () => {
  const nb = window.jupyterapp.shell.currentWidget.content;
  const i = nb.widgets.findIndex(c => c.model.sharedModel.getSource().startsWith('dash = run.dashboard()'));
  nb.activeCellIndex = i;
  await nb.scrollToCell(nb.widgets[i]);
  return i;
}"""


def _reopen(page, port: int, name: str, shot: Path) -> dict:
    """Save the notebook, shut its kernel down, open it again: what the snapshot looks like then."""
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=30_000)
    for k in _api(port, "kernels"):
        _api(port, f"kernels/{k['id']}", "DELETE")
    page.goto(f"http://127.0.0.1:{port}/lab/tree/{name}?token={TOKEN}&reset", wait_until="domcontentloaded")
    try:
        page.wait_for_function(f"() => ({KERNEL})() === 'idle'", timeout=90_000)
        page.evaluate(SCROLL_TO_DASHBOARD)  # a notebook may render only the cells in view
        page.wait_for_function(f"() => ({SNAPSHOT})().visible > 0", timeout=60_000)
        page.wait_for_function(f"() => ({SNAPSHOT})().images >= 2", timeout=30_000)
    except Exception:  # reported by the caller's assertion, with what the page shows
        pass
    snap = page.locator(".moelab-snapshot")
    if snap.count():
        snap.first.screenshot(path=str(shot))
    return page.evaluate(SNAPSHOT)


CANCEL_NOTEBOOK = [
    # a run long enough (minutes on two cores) that only a Cancel ends it within the test's patience
    "from moelab import Session\n"
    "run = Session('tiny', name='cancel-me', train={{'steps': 5000, 'device': 'cpu'}}).submit({submit})\n"
    "dash = run.dashboard()",
    "run.wait()\ndash.wait()\nprint('ended', run.status, 'at step', dash.state.step)",
]
FIRST_METRIC = r"""() => [...document.querySelectorAll('.widget-html-content')]
  .some(e => /loss\s*[0-9]/.test(e.textContent))"""
CELL_PROMPT = """(i) => document.querySelectorAll('.jp-CodeCell')[i].querySelector('.jp-InputPrompt').textContent"""
CELL_OUTPUT = """(i) => document.querySelectorAll('.jp-CodeCell')[i].querySelector('.jp-OutputArea').textContent"""


@pytest.mark.parametrize("executor", ["local", pytest.param("slurm", marks=pytest.mark.slurm)])
def test_cancel_during_a_blocking_wait(lab, tmp_path, request, executor):
    """Cancel is clicked while the next cell blocks in run.wait(): the run stops and that cell returns."""
    import nbformat
    from playwright.sync_api import sync_playwright

    if executor == "slurm":
        request.getfixturevalue("slurm_cluster")
    port, root = lab
    submit = "'local'" if executor == "local" else "'slurm', time=10"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.format(submit=submit)) for c in CANCEL_NOTEBOOK])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(root / "cancel.ipynb"))
    with sync_playwright() as p:
        ctx, page = _run_all(p, tmp_path, port, "cancel.ipynb")
        try:
            page.wait_for_function(FIRST_METRIC, timeout=300_000, polling=200)
            first_seen = time.time()
            page.wait_for_function(f"() => ({CELL_PROMPT})(1).includes('[*]')", timeout=60_000)  # blocked in wait()
            time.sleep(1.0)
            clicked = time.monotonic()
            page.locator(".jp-OutputArea-output button", has_text="Cancel").first.click()
            # the click must act now, not when the run's 5000 steps are over (minutes)
            page.wait_for_function(f"() => ({CELL_OUTPUT})(1).includes('ended')", timeout=120_000, polling=250)
            answered = time.monotonic() - clicked
            ended = page.evaluate(CELL_OUTPUT, 1)
            page.screenshot(path=str(tmp_path / "cancelled.png"))
        finally:
            ctx.close()
    info = json.loads(next((root / "runs").glob("cancel-me*/run.json")).read_text())
    steps = [json.loads(line) for line in next((root / "runs").glob("cancel-me*/metrics.jsonl")).open()
             if '"event": "step"' in line]
    print(f"\n[{executor}] submit -> first step event in metrics.jsonl: {steps[0]['time'] - info['created']:.1f} s; "
          f"submit -> first metric on the dashboard: {first_seen - info['created']:.1f} s; "
          f"Cancel -> the blocked cell returned: {answered:.1f} s")
    assert "ended CANCELLED" in ended, ended
    assert len(steps) < 5000


SURVIVOR_NOTEBOOK = [
    "from moelab import Session\n"
    "run = Session('tiny', name='survivor', train={'steps': 5000, 'device': 'cpu'}).submit('local', "
    "folder='runs/survivor')\n"
    "dash = run.dashboard()",
    "from moelab import Run\nrun = Run.load('runs/survivor')\ndash = run.dashboard()",
    "run.cancel()\nrun.wait()\nprint('ended', run.status)",
]
# The step count the dashboard in cell i shows ("<b>12</b> / 5000 steps"), -1 before it shows one.
STEP_SHOWN = r"""(i) => [-1, ...[...document.querySelectorAll('.jp-CodeCell')[i].querySelectorAll('.widget-html-content')]
  .map(e => e.textContent.match(/(\d+) \/ 5000 steps/)).filter(m => m).map(m => parseInt(m[1]))].pop()"""
RUN_CELL = """(i) => { const nb = window.jupyterapp.shell.currentWidget.content; nb.activeCellIndex = i;
  window.jupyterapp.commands.execute('notebook:run-cell'); return 1; }"""


def test_a_local_run_outlives_a_kernel_restart_and_its_dashboard_reattaches(lab, tmp_path):
    import nbformat
    from playwright.sync_api import sync_playwright

    from moelab import Run

    port, root = lab
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in SURVIVOR_NOTEBOOK])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(root / "survivor.ipynb"))
    folder = root / "runs" / "survivor"
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "chrome"), executable_path=CHROMIUM,
                                                   headless=True, args=CHROME_ARGS,
                                                   viewport={"width": 1280, "height": 1800})
        try:
            page = ctx.pages[0] if ctx.pages else ctx.new_page()
            page.goto(f"http://127.0.0.1:{port}/lab/tree/survivor.ipynb?token={TOKEN}&reset",
                      wait_until="domcontentloaded")
            page.wait_for_function(f"() => ({KERNEL})() === 'idle'", timeout=90_000)
            page.evaluate(RUN_CELL, 0)
            page.wait_for_function(FIRST_METRIC, timeout=300_000, polling=200)
            (kernel,) = _api(port, "kernels")
            _api(port, f"kernels/{kernel['id']}/restart", "POST")
            restarted = time.time()
            page.wait_for_function(f"() => ({KERNEL})() === 'idle'", timeout=90_000)
            assert Run.load(folder).status == "RUNNING"            # the restart did not take the run with it
            page.evaluate(RUN_CELL, 1)                             # reattach from the new kernel
            page.wait_for_function(f"() => ({STEP_SHOWN})(1) > 0", timeout=120_000, polling=250)
            seen = page.evaluate(STEP_SHOWN, 1)
            page.wait_for_function(f"() => ({STEP_SHOWN})(1) > {seen}", timeout=120_000, polling=250)
            grown = page.evaluate(STEP_SHOWN, 1)
            page.screenshot(path=str(tmp_path / "reattached.png"))
            page.evaluate(RUN_CELL, 2)
            page.wait_for_function(f"() => ({CELL_OUTPUT})(2).includes('ended')", timeout=120_000, polling=250)
            ended = page.evaluate(CELL_OUTPUT, 2)
        finally:
            ctx.close()
    steps = [json.loads(line) for line in (folder / "metrics.jsonl").open() if '"event": "step"' in line]
    after = [e["step"] for e in steps if e["time"] > restarted]
    assert after and grown > seen, (seen, grown, after[:3])   # it trained on after the restart, and was followed
    assert "ended CANCELLED" in ended, ended


def _shoot(page, path: Path) -> Path:
    """A screenshot of the dashboard widget alone (the first widget box in an output)."""
    page.locator(".jp-OutputArea-output .widget-vbox").first.screenshot(path=str(path))
    return path


KNOB_NOTEBOOK = [
    "from moelab import Session\n"
    "run = Session('tiny', name='knob', train={'steps': 5000, 'device': 'cpu'}).submit('local', folder='runs/knob')\n"
    "dash = run.dashboard()",
    "run.wait()\nprint('ended', run.status)",
]
# the dashboard's list of applied changes (moelab.live.controls.ControlsBar.show)
KNOB_SHOWN = r"""() => [...document.querySelectorAll('.widget-html-content')]
  .some(e => /after step \d+: model.moe.aux_loss_coeff 0.01 → 0.05/.test(e.textContent))"""


def test_a_knob_set_from_the_dashboard_during_a_blocking_wait(lab, tmp_path):
    """While the next cell blocks in run.wait(), the dashboard's controls set aux_loss_coeff: the ranks apply it
    at a step boundary (a `control` event) and the dashboard shows it, all before the run ends."""
    import nbformat
    from playwright.sync_api import sync_playwright

    from moelab import Run

    port, root = lab
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in KNOB_NOTEBOOK])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(root / "knob.ipynb"))
    folder = root / "runs" / "knob"
    with sync_playwright() as p:
        ctx, page = _run_all(p, tmp_path, port, "knob.ipynb")
        try:
            page.wait_for_function(FIRST_METRIC, timeout=300_000, polling=200)
            page.wait_for_function(f"() => ({CELL_PROMPT})(1).includes('[*]')", timeout=60_000)  # blocked in wait()
            out = page.locator(".jp-OutputArea-output").first
            out.locator("select").first.select_option("model.moe.aux_loss_coeff")
            out.locator(".widget-text input").first.fill("0.05")
            clicked = time.monotonic()
            out.locator("button", has_text="Apply").first.click()
            page.wait_for_function(KNOB_SHOWN, timeout=120_000, polling=250)
            shown = time.monotonic() - clicked
            still_waiting = "[*]" in page.evaluate(CELL_PROMPT, 1)
        finally:
            page.screenshot(path=str(tmp_path / "knob.png"))
            (tmp_path / "knob.json").write_text(json.dumps(page.evaluate(PROBE), indent=1))
            Run.load(folder).cancel()
            ctx.close()
    (control,) = [json.loads(line) for line in (folder / "metrics.jsonl").open() if '"event": "control"' in line]
    print(f"\nApply -> the change shown on the dashboard: {shown:.1f} s (applied after step {control['step']})")
    assert control["field"] == "model.moe.aux_loss_coeff" and control["new"] == 0.05
    assert control["who"].endswith("dashboard")
    assert still_waiting, "the run ended before the change was shown"
