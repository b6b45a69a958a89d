"""TensorBoard and W&B as readers of the metrics stream: the trainer writes metrics.jsonl as always, and these
mirror it, live (train.tensorboard, train.wandb: a thread on rank 0 tailing the stream) or after the fact
(``moelab export RUN --to tensorboard``). Nothing here reaches into the trainer.

Scalars per step: train/loss, train/aux_loss, train/z_loss, train/lr, train/grad_norm, perf/tokens_per_s,
perf/tokens_per_s_per_gpu, perf/tflops_per_gpu, perf/mfu, perf/step_time_s, memory/max_peak_allocated_gb,
and per MoE layer routing/max_over_mean/layer_L (the router's demand) and routing/dropped/layer_L; per eval
event eval/loss and eval/perplexity. TensorBoard files go to RUN/tensorboard, W&B offline runs to RUN/wandb
(``wandb sync RUN/wandb/offline-run-*`` uploads one later).

    export_run("runs/tiny", to="tensorboard")      # RUN/tensorboard/events.out.tfevents.*
    mirror = StreamMirror("runs/tiny", cfg); mirror.start(); ...; mirror.stop()
"""
from __future__ import annotations

import threading
from pathlib import Path

from moelab.config import Config, ConfigError
from moelab.config.paths import check_path
from moelab.contract.events import EvalEvent, Event, StepEvent
from moelab.contract.folder import METRICS, TENSORBOARD, RunFolder
from moelab.contract.stream import JsonlTail, scan_events

STEP_SCALARS = {"loss": "train/loss", "aux_loss": "train/aux_loss", "z_loss": "train/z_loss", "lr": "train/lr",
                "grad_norm": "train/grad_norm", "tokens_per_s": "perf/tokens_per_s",
                "tokens_per_s_per_gpu": "perf/tokens_per_s_per_gpu", "tflops_per_gpu": "perf/tflops_per_gpu",
                "mfu": "perf/mfu", "step_time_s": "perf/step_time_s"}
EVAL_SCALARS = {"loss": "eval/loss", "perplexity": "eval/perplexity"}


def scalars(event: Event) -> dict[str, float]:
    """The scalars of one step or eval event ({} for other events), by tag."""
    if isinstance(event, EvalEvent):
        return {tag: float(getattr(event, k)) for k, tag in EVAL_SCALARS.items() if getattr(event, k) is not None}
    if not isinstance(event, StepEvent):
        return {}
    out = {tag: float(getattr(event, k)) for k, tag in STEP_SCALARS.items() if getattr(event, k) is not None}
    mem = event.memory.max_peak_allocated_gb if event.memory is not None else None
    if mem is not None:
        out["memory/max_peak_allocated_gb"] = float(mem)
    routing = event.routing
    if routing is None:
        return out
    for layer, counts in enumerate(routing.routed_per_expert_ME or routing.tokens_per_expert_ME or []):
        mean = sum(counts) / len(counts) if counts else 0.0
        if mean > 0:
            out[f"routing/max_over_mean/layer_{layer}"] = max(counts) / mean
    for layer, dropped in enumerate(routing.dropped_tokens_M or []):
        out[f"routing/dropped/layer_{layer}"] = float(dropped)
    return out


class TensorBoardSink:
    """Writes scalars as TensorBoard event files (torch.utils.tensorboard; needs the tensorboard package).

        sink = TensorBoardSink("runs/tiny/tensorboard"); sink.write({"train/loss": 2.0}, step=1); sink.close()
    """

    def __init__(self, folder: "str | Path", config: dict | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = Path(folder)
        self.writer = SummaryWriter(log_dir=str(self.folder))
        if config:
            import yaml

            self.writer.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "\n```", 0)

    def write(self, values: dict[str, float], step: int) -> None:
        for tag, v in values.items():
            self.writer.add_scalar(tag, v, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Logs scalars to Weights & Biases: mode "offline" (RUN/wandb, no network) or "online".

        sink = WandbSink("runs/tiny", "offline", name="tiny"); sink.write({"train/loss": 2.0}, 1); sink.close()
    """

    def __init__(self, run_dir: "str | Path", mode: str, name: str = "", config: dict | None = None):
        import wandb

        self.run = wandb.init(project="moelab", name=name or Path(run_dir).name, dir=str(run_dir), mode=mode,
                              config=config or {}, reinit="create_new")
        self.last_step = -1

    def write(self, values: dict[str, float], step: int) -> None:
        if step >= self.last_step:  # W&B steps only go forward (a resumed run's repeated steps are skipped)
            self.run.log(values, step=step)
            self.last_step = step

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


def check_export(cfg: Config) -> None:
    """train.tensorboard / train.wandb need their packages: a ConfigError naming the field before the run."""
    import importlib.util

    if cfg.train.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("train.tensorboard=True: needs the tensorboard package; pip install tensorboard "
                          "(or moelab[export]), or set train.tensorboard=false")
    if cfg.train.wandb != "off" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"train.wandb={cfg.train.wandb!r}: needs the wandb package; pip install wandb "
                          f"(or moelab[export]), or set train.wandb=off")


def sinks_for(cfg: Config, run_dir: Path) -> list:
    check_export(cfg)
    out = []
    if cfg.train.tensorboard:
        out.append(TensorBoardSink(Path(run_dir) / TENSORBOARD, cfg.to_dict()))
    if cfg.train.wandb != "off":
        out.append(WandbSink(run_dir, cfg.train.wandb, cfg.name, cfg.to_dict()))
    return out


class StreamMirror:
    """A thread that tails RUN/metrics.jsonl and hands every step and eval event to the sinks; stop() reads
    the rest of the stream, then closes them.

        mirror = StreamMirror(run_dir, cfg); mirror.start(); ...; mirror.stop()
    """

    def __init__(self, run_dir: "str | Path", cfg: Config, poll_s: float = 1.0, after_step: int = 0):
        self.run_dir, self.poll_s, self.after_step = Path(run_dir), poll_s, after_step  # resumed: mirrored before
        self.sinks = sinks_for(cfg, self.run_dir)
        self.tail = JsonlTail(RunFolder(self.run_dir).metrics, typed=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="moelab-export", daemon=True)

    def start(self) -> "StreamMirror":
        self._thread.start()
        return self

    def _drain(self) -> None:
        for event in self.tail.poll():
            values = scalars(event)
            if values and event.step > self.after_step:
                for sink in self.sinks:
                    sink.write(values, int(event.step))

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._drain()
            for sink in self.sinks:
                sink.flush()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._drain()
        for sink in self.sinks:
            sink.close()


def export_run(run_dir: "str | Path", to: str = "tensorboard", out: "str | Path | None" = None,
               wandb_mode: str = "offline") -> Path:
    """Write a finished (or live) run's stream to TensorBoard files (in `out`, default RUN/tensorboard) or to
    an offline/online W&B run; returns the folder written."""
    from moelab.config import load_config

    run_dir = Path(run_dir)
    run = RunFolder(run_dir)
    if not run.metrics.is_file():
        raise FileNotFoundError(f"{run_dir}: not a run folder (no {METRICS})")
    config = load_config(run.config).to_dict() if run.config.is_file() else {}
    if out:
        check_path("out", out, "folder to write", f"give a folder for the {to} files (moelab export RUN --out FOLDER)")
    if to == "tensorboard":
        folder = Path(out) if out else run_dir / TENSORBOARD
        sink = TensorBoardSink(folder, config)
    elif to == "wandb":
        folder = Path(out) if out else run_dir
        sink = WandbSink(folder, wandb_mode, config.get("name", run_dir.name), config)
        folder = folder / "wandb"
    else:
        raise ValueError(f"export: to={to!r}; choose 'tensorboard' or 'wandb'")
    try:
        for event in scan_events(run.metrics, kinds=("step", "eval")):  # line by line
            values = scalars(event)
            if values:
                sink.write(values, int(event.step))
    finally:
        sink.close()
    return folder
