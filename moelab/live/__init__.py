"""Watching runs: the live dashboard (widgets in a notebook, a progress line elsewhere) and static plots.

    from moelab.live import dashboard, plot_routing
    dash = dashboard(run)          # or a Sweep, or a run folder; returns at once
    dash.wait()                    # in a notebook's last cell: block until the run ends
    plot_routing(run, layer=0)     # a matplotlib Figure

Modules: state (metrics events -> DashState), monitor (the daemon-thread driver, `dashboard`), widget
(ipywidgets view), kernel (widget callbacks on a kernel subshell, so Cancel answers while a cell blocks),
text (terminal view), plots (Figures and `write_report`).
"""
from moelab.live.monitor import Dashboard, dashboard, in_notebook
from moelab.live.plots import plot_memory, plot_routing, plot_throughput, write_report
from moelab.live.state import DashState, load_state

__all__ = ["Dashboard", "DashState", "dashboard", "in_notebook", "load_state", "plot_memory", "plot_routing",
           "plot_throughput", "write_report"]
