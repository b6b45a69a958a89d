"""The training loop that runs on every rank.

One optimizer step = the global batch, split into micro batches; this rank trains its data-parallel share with
gradient accumulation. Exactly one host synchronisation per step: every statistic the step needs (loss, grad
norm, routing counts) is packed into one tensor, summed over ranks, and read once; the non-finite check uses the
same read, before the optimizer steps.

    summary = Trainer(load_config("tiny"), "runs/tiny").run()
"""
from __future__ import annotations

import copy
import math
import os
import platform
import resource
import socket
import time
import traceback
from pathlib import Path

import torch

from moelab.config import Config, ConfigError, save_config
from moelab.backends.grad_norm import squares_in_backward
from moelab.model.batch_context import BatchContext
from moelab.model.router import PER_EXPERT_STATS, ROUTER_STATS, SUMMED_STATS
from moelab.planner.flops import FLOPS_CONVENTION, count_params, flops_per_token, peak_tflops
from moelab.parallel.deepep import close_dispatchers
from moelab.train.preflight import preflight
from moelab.parallel.env import DistEnv
from moelab.contract.folder import RunFolder
from moelab.train.checkpoint import Checkpointer, DiskFullError, list_checkpoints
from moelab.train.controls import Controls, drop_frozen_grads
from moelab.data.batches import make_dataset, micro_batch
from moelab.data.transfer import to_device
from moelab.train.evaluate import Evaluator
from moelab.train.expert_tokens import ExpertTokenRecorder
from moelab.loggers.mirror import StreamMirror
from moelab.train.expert_lr import ExpertLR
from moelab.train.health import ExpertHealth
from moelab.backends.full_loss import loss_mask
from moelab.contract.events import (CheckpointEvent, EndEvent, ErrorEvent, EvalEvent, RunEnv, StartEvent,
                                    StepEvent, WarningEvent, parse_event)
from moelab.contract.folder import write_json
from moelab.contract.stream import MetricsWriter, scan_events
from moelab.contract.writes import FolderWriteError, write_atomic
from moelab.config.schedule import lr_at
from moelab.train.optim import build_optimizer, set_lr
from moelab.train.overlap import OptimizerOverlap
from moelab.train.signals import StopNow, StopSignals
from moelab.train.stats import StatsPack
from moelab.contract.summary import summarize

# the router's statistics whose name in the stream's routing record (moelab.contract.events.Routing) differs
STREAM_NAMES = {"dropped": "dropped_tokens"}


class NonFiniteLoss(RuntimeError):
    """A step's loss or gradient norm was not finite and train.on_nan='stop'.

        raise NonFiniteLoss("non-finite loss at step 3: ...")
    """


class Trainer:
    """The training loop of one rank: setup (model on meta, parallelize, restore), steps, checkpoints, end.

        summary = Trainer(load_config("tiny"), "runs/tiny").run()
    """
    def __init__(self, cfg: Config, run_dir: "str | Path", env: DistEnv | None = None, progress: bool = False):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.folder = RunFolder(run_dir)  # the file names of the run folder
        self.env = env or DistEnv.from_environ(cfg.train.device)
        if cfg.train.device != "auto" and self.env.device.split(":")[0] != cfg.train.device:
            raise ConfigError(f"train.device={cfg.train.device!r} but this rank's DistEnv runs on "
                              f"{self.env.device!r}; pass env=DistEnv.from_environ({cfg.train.device!r}) (or none)")
        self.progress = progress and self.env.rank == 0
        self.writer: MetricsWriter | None = None
        self.step = 0
        self.stop = StopSignals()  # SIGTERM/SIGUSR1/SIGUSR2 -> checkpoint at the next step boundary, PREEMPTED
        self.stop_requested = False  # agreed by all ranks through the step's one all-reduce
        self.health = ExpertHealth(cfg.model.moe)
        self.mirror: StreamMirror | None = None  # TensorBoard / W&B, reading the stream (moelab.loggers.mirror)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Everything before the first step: the layout and its checks, the model and optimizer, the data, the
        resume from the newest checkpoint with the live changes in force there, and rank 0's stream."""
        cfg, env = self.cfg, self.env
        env.init(cfg.train.collective_timeout_s)
        self.dims = preflight(cfg, env.world_size, "rank")  # the layout, the packages (moelab.train.preflight)
        self.layout = self.dims.layout
        torch.manual_seed(cfg.train.seed)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # refuses another config's folder; a copy: live controls change self.cfg (moelab.train.controls), the
        # checkpoints keep the folder's config
        self.checkpointer = Checkpointer(self.run_dir, copy.deepcopy(cfg), env, self.layout)
        if env.rank == 0:
            save_config(cfg, self.folder.config)
        self.dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
        self._build()
        t = cfg.train
        self.micro_per_rank = t.global_batch_size // (t.micro_batch_size * self.par.dp_size)
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self.gpu_name = torch.cuda.get_device_name(env.device) if env.is_cuda else platform.processor() or "cpu"
        self.peak = peak_tflops(self.gpu_name, t.dtype) if env.is_cuda else None
        self.writer = MetricsWriter(self.folder.metrics) if env.rank == 0 else None  # writes nothing yet
        self._resume()
        if env.rank == 0:
            self._start_stream()

    def _build(self) -> None:
        """The model (its weights from train.init_from where given), the optimizer, the data and what the
        trainer builds from the config (rebuild_from_config)."""
        from moelab.model.assemble import assemble
        from moelab.parallel.apply import parallelize

        cfg, env = self.cfg, self.env
        self.loaded = None  # {"bytes_read_per_rank", ...} when the weights came from train.init_from
        load = None
        # a resume restores its own weights, except LoRA's frozen base, which its checkpoints do not hold
        if cfg.train.init_from and (cfg.train.lora.rank or not list_checkpoints(self.run_dir)):
            from moelab.hf.sharded_load import load_into

            def load(model):
                self.loaded = load_into(model, cfg, progress=self.progress)  # this rank's slices only

        # the model's life (meta build, FP8, LoRA, placement, init, load): moelab.model.assemble
        # (the model computes its loss: moelab.backends.loss)
        self.par = assemble(cfg, "train", env.device, load=load,
                            place=lambda model: parallelize(model, cfg, env, self.dims))
        self.model = self.par.model
        self.optimizer = build_optimizer(self.model, cfg)
        # the step on a side stream, overlapped with the next forward (one GPU; None elsewhere)
        self.overlap = OptimizerOverlap.attach(self.model, self.optimizer, cfg, env.world_size,
                                               pipeline=self.par.pipeline is not None)
        self.dataset = make_dataset(cfg, progress=self.progress)  # bad data is a ConfigError here
        self.expert_lr = self.evaluator = self.expert_tokens = None
        self.rebuild_from_config()

    def rebuild_from_config(self) -> None:
        """(Re)build what the trainer derives from its config: the per-expert learning-rate hook, the evaluator
        and the expert-token recorder. At setup, and after a live change of one of their fields
        (moelab.train.controls.REBUILT)."""
        cfg = self.cfg
        if self.expert_lr is not None:
            self.expert_lr.remove()
        self.expert_lr = ExpertLR.attach(self.optimizer, self.par.moe_layers_all, cfg)
        if cfg.train.eval_every and self.evaluator is None:
            self.evaluator = Evaluator(self)
        if cfg.train.expert_tokens_every and self.expert_tokens is None:
            self.expert_tokens = ExpertTokenRecorder(self)

    def _resume(self) -> None:
        """Continue after the newest intact checkpoint, if any (metrics.jsonl is rewound to it), with the live
        changes in force there; replays of those applied after it are scheduled."""
        env = self.env
        self.restored = self.checkpointer.restore(self.model, self.optimizer, self.folder.metrics,
                                                  meshes=getattr(self.par, "meshes", None))
        self.par.load_rank_state(self.restored.rank_state)  # e.g. error-feedback residuals
        self.controls = Controls(self.cfg, self.run_dir, self.par.moe_layers, rebuild=self.rebuild_from_config,
                                 rank0=env.rank == 0, writer=self.writer)
        self.controls.restore(self.restored.rank_state, self.restored.step)
        self.start_step = self.saved_step = self.restored.step
        self.step = self.start_step
        # the eval events kept by the rewind above (steps <= start_step), for the summary
        self.evals = scan_events(self.folder.metrics, kinds=("eval",)) if self.start_step and env.rank == 0 else []

    def _start_stream(self) -> None:
        """Rank 0: the tokenizer's copy, the start event (the config as it trains, with the changes in force),
        the resume's warnings, and the TensorBoard / W&B mirror."""
        cfg, env, t = self.cfg, self.env, self.cfg.train
        tok = getattr(getattr(self.dataset, "tokenizer", None), "path", None)
        if tok is not None:  # readers decode token ids with it (moelab.live.expert_tokens)
            write_atomic(self.folder.tokenizer, Path(tok).read_bytes())
        params = count_params(cfg.model)
        self.writer.emit(StartEvent(
            config=cfg.to_dict(), total_steps=t.steps, start_step=self.start_step,
            resumed_from=str(self.restored.path) if self.restored.path else None,
            flops_per_token=self.flops_per_token, flops_convention=FLOPS_CONVENTION, init_from=self.loaded,
            total_params=params.total, activated_params=params.activated,
            env=RunEnv(torch=torch.__version__, python=platform.python_version(), host=socket.gethostname(),
                       device=env.device, gpu_name=self.gpu_name, world_size=env.world_size,
                       layout={k: getattr(self.layout, k) for k in ("tp", "pp", "cp", "ep", "vp", "fsdp")},
                       pid=os.getpid(), slurm_job_id=os.environ.get("SLURM_JOB_ID"))))
        for w in self.restored.warnings:
            self.writer.emit(WarningEvent(**w))
        if cfg.train.tensorboard or cfg.train.wandb != "off":
            self.mirror = StreamMirror(self.run_dir, cfg, after_step=self.start_step).start()

    # ------------------------------------------------------------------ one step
    def forward_backward(self, step: int) -> torch.Tensor:
        """Forward and backward over this rank's micro batches; returns the summed micro-batch losses. Under
        train.fp8 with several micro batches the expert weights are quantised once for all of them."""
        if self.cfg.train.fp8 != "off" and self.micro_per_rank > 1:
            from moelab.model.fp8_cache import expert_weights_cached

            self.join_optimizer()  # the cache reads the expert weights before the blocks' forward
            with expert_weights_cached(self.model, self.dtype if self.env.is_cuda else None):
                return self.micro_batches(step)
        return self.micro_batches(step)

    def micro_batches(self, step: int) -> torch.Tensor:
        t, par = self.cfg.train, self.par
        loss_scale = 1.0 / self.micro_per_rank  # a micro batch's weight in the step's loss (the router losses')
        if par.pipeline is not None:  # pipeline parallel: the schedule runs this rank's micro batches
            size = self.micro_per_rank * t.micro_batch_size
            batch = to_device(micro_batch(self.dataset, step, par.dp_rank * size, size), self.env.device)
            return par.pipeline.forward_backward(batch[:, :-1], batch[:, 1:], BatchContext(loss_scale=loss_scale))
        loss_sum = torch.zeros((), device=self.env.device)
        for i in range(self.micro_per_rank):
            par.start_micro_batch(i, self.micro_per_rank)  # which backward reduces gradients over ranks
            first = (par.dp_rank * self.micro_per_rank + i) * t.micro_batch_size
            documents = None
            if self.cfg.data.kind == "sft":  # chats: loss masks, packed documents (moelab.data.sft_batches)
                sft = self.dataset.micro_batch(step, first, t.micro_batch_size).to(self.env.device)
                inputs, targets, positions, mask = sft.inputs_BL, sft.targets_BL, sft.positions_BL, sft.valid_BL
                documents = sft.documents_BL  # attention within each packed example
            else:
                # to_device: pinned, so the copy cannot wait for the queued micro batches (a pageable one may)
                batch = to_device(micro_batch(self.dataset, step, first, t.micro_batch_size), self.env.device)
                inputs, targets = par.shard_sequence(batch[:, :-1]), par.shard_sequence(batch[:, 1:])
                mask = loss_mask(targets, self.cfg.model.pad_token_id)  # padding: out of the loss and routing
                positions = par.positions(t.seq_len, self.env.device)
            ctx = BatchContext(token_mask_BL=mask, documents_BL=documents, loss_scale=loss_scale)
            with torch.autocast(self.env.device.split(":")[0], dtype=self.dtype,
                                enabled=self.dtype != torch.float32 and not par.casts_params):
                # the LM head and its loss inside the model's forward (FSDP2 has gathered the head there)
                loss = self.model(inputs, positions, targets_BL=targets, ctx=ctx)
            # the last micro batch's backward leaves the gradients final: a GEMM that writes one whole may sum
            # its squares for the step's norm (moelab.backends.grad_norm)
            with squares_in_backward(i == self.micro_per_rank - 1):
                (loss / self.micro_per_rank).backward()
            loss_sum += loss.detach()
        return loss_sum

    def train_step(self, step: int, metrics: bool = True) -> dict:
        """One optimizer step. metrics=False (moelab.train.bench's metrics-overhead variant) makes the same updates
        (optimizer, expert learning rates, router bias, capacity) without collecting metrics: only the routing
        counts those updates need are summed over ranks, on the device; nothing is read on the host, so there
        is no non-finite check either. Returns {"step", "lr"} then."""
        cfg, par = self.cfg, self.par
        lr = lr_at(step, cfg)
        set_lr(self.optimizer, lr)
        loss_sum = self.forward_backward(step)
        par.finish_gradients()  # replicated experts' gradient exchange (moelab.parallel.replicate)
        drop_frozen_grads(par.moe_layers, cfg)  # model.moe.freeze_router
        # clipping's multiply in the optimizer's update where it takes it (TritonAdamW: no pass over the gradients)
        later = getattr(self.optimizer, "clip_in_step", None)
        if later is not None:
            later(None)  # this step's factor, if it clips
        grad_norm = par.clip_grad_norm(self.model, cfg.train.grad_clip, multiply_later=later)
        stats = [m.router.pop_stats() if m is not None else None for m in par.moe_layers_all]
        E, n_layers = cfg.model.moe.num_experts, len(stats)
        if not metrics:
            counts = [s[key].float().reshape(-1) if s is not None else torch.zeros(E, device=self.env.device)
                      for key in PER_EXPERT_STATS for s in stats]
            self.apply_step(par.all_reduce_sum(torch.cat(counts)).view(2, n_layers, E) if n_layers else None)
            return {"step": step, "lr": lr}
        # The one synchronisation: loss, grad norm, routing statistics and per-rank memory are packed into one
        # tensor, summed over ranks (each rank's contribution is weighted so the sum is the global value), and
        # read once.
        comm = par.pop_comm_counts()  # bytes sent and the like, counted on the host (moelab.parallel)
        pack = self._pack_step(step, loss_sum, grad_norm, stats, comm)
        packed = par.all_reduce_sum(pack.pack())
        # the summed counts stay on the device for the routing updates (queued before the read: the GPU's wait
        # between the backward and the optimizer is the host's work after the read)
        counts_2ME = torch.stack([packed[pack.slice(key)] for key in PER_EXPERT_STATS]).view(2, n_layers, E)
        got = pack.unpack(packed.tolist())
        loss = got["loss"][0] / (self.micro_per_rank * par.dp_size)
        gnorm = got["grad_norm"][0]
        self._read_step_flags(got, comm)
        skipped = not self._finite(step, loss, gnorm)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.apply_step(counts_2ME if n_layers else None)
        # per MoE layer: a list of E counts (routed_per_expert: before dropping), or one value
        per_layer = {key: [got[key][i * E: (i + 1) * E] for i in range(n_layers)] if key in PER_EXPERT_STATS
                     else got[key] for key in ROUTER_STATS}
        aux_loss, z_loss = sum(per_layer.pop("aux_loss")), sum(per_layer.pop("z_loss"))  # over MoE layers
        return {"step": step, "loss": loss, "grad_norm": gnorm, "lr": lr, "skipped": skipped,
                "aux_loss": aux_loss, "z_loss": z_loss, "comm": comm,
                "routing": {STREAM_NAMES.get(key, key): v for key, v in per_layer.items()}}

    def _pack_step(self, step: int, loss_sum, grad_norm, stats: list, comm: dict) -> StatsPack:
        """What the step's one all-reduce sums: this rank's loss and grad-norm contributions, its routers'
        statistics (counts summed, the others weighted so the sum is the mean over ranks), its memory in its
        own slot, the communication counts, a stop request and rank 0's "a live change is due"."""
        par, dev, E = self.par, self.env.device, self.cfg.model.moe.num_experts
        pack = StatsPack()
        pack.add("loss", par.loss_contribution(loss_sum))
        pack.add("grad_norm", grad_norm.reshape(1).float() * par.grad_norm_weight())
        for key in ROUTER_STATS:
            size = E if key in PER_EXPERT_STATS else 1
            w = 1.0 if key in SUMMED_STATS else par.stat_weight()
            pack.add(key, [s[key].float().reshape(-1) * w if s is not None else torch.zeros(size, device=dev)
                           for s in stats])
        memory_slots = torch.zeros(self.env.world_size, 3, device=dev)
        # to_device: a copy from pageable memory may wait for the step's queued work (a second sync)
        memory_slots[par.rank_slot()] = to_device(torch.tensor(self.memory_now()), dev)
        pack.add("memory", memory_slots)
        for key, v in comm.items():
            pack.add(f"comm.{key}", to_device(torch.tensor(v, dtype=torch.float32), dev))
        pack.add("stop", to_device(torch.tensor([float(self.stop.requested)]), dev))  # any rank stops all
        pack.add("controls", to_device(torch.tensor([self.controls.poll(step)]), dev))  # rank 0: a change is due
        return pack

    def _read_step_flags(self, got: dict, comm: dict) -> None:
        """From the summed pack: every rank's memory, the communication counts (in `comm`), whether a rank was
        asked to stop and whether a live change is due."""
        self.last_memory = [got["memory"][3 * r: 3 * r + 3] for r in range(self.env.world_size)]
        for key, v in comm.items():  # summed over ranks; one number, or a list (a histogram)
            comm[key] = got[f"comm.{key}"][0] if len(v) == 1 else got[f"comm.{key}"]
        self.stop_requested = got["stop"][0] > 0
        self.controls_due = got["controls"][0] > 0

    def _finite(self, step: int, loss: float, gnorm: float) -> bool:
        """Are the step's loss and grad norm finite? NonFiniteLoss when not and train.on_nan is "stop"."""
        if math.isfinite(loss) and math.isfinite(gnorm):
            return True
        if self.cfg.train.on_nan == "stop":
            raise NonFiniteLoss(f"non-finite loss at step {step}: loss={loss}, grad_norm={gnorm}. "
                                f"{self.nonfinite_hint()}Set train.on_nan='skip' to skip such steps.")
        return False

    def apply_step(self, counts_2ME: "torch.Tensor | None") -> None:
        """The optimizer step and the routing updates after it, from the per-expert token counts summed over
        ranks ([tokens kept, tokens routed] x layers x experts, on the device; None without MoE layers)."""
        if self.overlap is not None and self.expert_lr is None:
            self.overlap.step()  # on its side stream; the next forward waits for each block's update
        else:  # ExpertLR rescales the update on this stream right after it
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if counts_2ME is None:
            return
        counts, routed = counts_2ME
        if self.expert_lr is not None:
            self.expert_lr.apply(counts)
        for i, moe in enumerate(self.par.moe_layers_all):
            if moe is not None:
                moe.router.update_bias(routed[i])
                moe.router.update_capacity(routed[i])

    def join_optimizer(self) -> None:
        """This stream waits for the optimizer's update still running beside it (train.optimizer_overlap): before
        anything but the forward reads the weights or the optimizer's state."""
        if self.overlap is not None:
            self.overlap.join()

    def nonfinite_hint(self) -> str:
        """Name the first parameter with a non-finite gradient (cheap: only computed when a step fails)."""
        for name, p in self.model.named_parameters():
            g = p.grad
            if g is not None:
                g = g.full_tensor() if hasattr(g, "full_tensor") else g
                if not torch.isfinite(g).all():
                    return f"First non-finite gradient: {name}. "
        return ""

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        # the stop handlers live exactly as long as run() (restored in `finally`): a Trainer only set up (bench,
        # tests) leaves none behind, whose pass-on a later run's chain() would reach
        self.stop.install()
        now = None
        try:
            self.setup()
            summary = self._loop()
        except StopNow as e:  # a second stop signal mid-step: the end is recorded, then the signal acts
            now = e
            if self.writer:
                self.writer.emit(EndEvent(step=self.step, status="CANCELLED" if self.cancelled() else "PREEMPTED",
                                          summary={"stopped_by": str(e), "checkpoint_step": self.saved_step}))
        except BaseException as e:
            self._report_error(e)
            raise
        finally:
            if self.writer:
                self.writer.close()
            if self.mirror:
                self.mirror.stop()
            self.stop.restore()
        if now is not None:
            self.stop.act_now(now.signum)
        if summary["status"] == "PREEMPTED":
            self.stop.chain()  # e.g. submitit's handler: requeues the job (which resumes) and exits
        return summary

    def _loop(self) -> dict:
        t = self.cfg.train
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=t.steps, initial=self.start_step, desc=self.cfg.name, unit="step")
        records = list(self.restored.records)  # the steps before a resume count in the summary
        t_prev = time.perf_counter()
        if self.env.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.env.device)
        status = "COMPLETED"
        self.stop.deferring = True  # from here a stop signal waits for the step boundary (moelab.train.signals)
        self.controls.poll(self.start_step)
        self.controls.apply(self.start_step)  # changes asked for before the start (a fork's)
        for step in range(self.start_step + 1, t.steps + 1):
            self.step = step
            rec = self.train_step(step)
            records.append(self._record_step(step, rec, t_prev))
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}")
                bar.update(1)
            self.after_step(step, last=step == t.steps or self.stop_requested)
            checkpoint_now = self.controls_due and self.controls.apply(step)  # live changes, every rank
            t_prev = time.perf_counter()  # evaluation is not the next step's time
            if self.stop_requested:
                # a cancel (Run.cancel / moelab cancel writes cancel_requested, then signals) ends CANCELLED
                status = "CANCELLED" if self.cancelled() else "PREEMPTED"
                break
            if (t.checkpoint_every and step % t.checkpoint_every == 0) or checkpoint_now:
                self.save_checkpoint(step)
        self.join_optimizer()  # the weights are final for whoever reads them after the run
        if self.saved_step != self.step:  # at the end, and on a stop signal
            self.save_checkpoint(self.step)
        if status == "COMPLETED":  # rank 0: no request is left pending; a later one is refused
            saved = self.cfg.train.save_checkpoints and self.saved_step == self.step
            self.controls.close(self.step, status, checkpointed=saved)
        if bar is not None:
            bar.close()
        return self._finish(records, status)

    def _record_step(self, step: int, rec: dict, t_prev: float) -> StepEvent:
        """A trained step's record completed (experts' health, throughput since `t_prev`, memory) as its
        StepEvent, checked as a reader checks it, and written with the health warnings on rank 0."""
        t = self.cfg.train
        tokens_per_step = t.global_batch_size * t.seq_len
        rec["health"], warnings = self.health.observe(step, rec["routing"]["routed_per_expert"])
        dt = time.perf_counter() - t_prev
        tps = tokens_per_step / dt
        tflops = self.flops_per_token * tps / self.env.world_size / 1e12
        rec.update(tokens=tokens_per_step, step_time_s=dt, tokens_per_s=tps,
                   tokens_per_s_per_gpu=tps / self.env.world_size, tflops_per_gpu=tflops,
                   mfu=tflops / self.peak if self.peak else None, memory=self.memory())
        event = parse_event({"event": "step", **rec})
        if self.writer:
            self.writer.emit(event)
            for w in warnings:
                self.writer.emit(WarningEvent(**w))
        return event

    def _finish(self, records: list, status: str) -> dict:
        """The summary (rank 0 writes the end event and summary.json); DeepEP's buffers freed, the process
        group ended."""
        summary = summarize(self.cfg, records, status=status, start_step=self.start_step, evals=self.evals)
        if self.writer:
            self.writer.emit(EndEvent(step=self.step, status=status, summary=summary))
            write_json(self.folder.summary, summary)
        close_dispatchers(self.par.moe_layers)  # DeepEP's buffer: freed by all EP ranks together
        self.env.shutdown()
        return summary

    def after_step(self, step: int, last: bool) -> None:
        """Held-out evaluation and expert-token records, every N steps and after the last step (all ranks)."""
        t = self.cfg.train
        evaluate = self.evaluator is not None and (step % t.eval_every == 0 or last)
        record = self.expert_tokens is not None and (step % t.expert_tokens_every == 0 or last)
        if evaluate or record:
            self.join_optimizer()  # both run the model's parts on this stream
        if evaluate:
            event = EvalEvent(**self.evaluator.run(step))
            self.evals.append(event)
            if self.writer:
                self.writer.emit(event)
        if record:
            self.expert_tokens.record(step)

    def save_checkpoint(self, step: int) -> None:
        saved = self.cfg.train.save_checkpoints
        if saved:
            self.join_optimizer()
            path = self.checkpointer.save(step, self.model, self.optimizer, getattr(self.par, "meshes", None),
                                          rank_state={**self.par.rank_state(), **self.controls.rank_state()})
            self.saved_step = step
            if self.writer:
                self.writer.emit(CheckpointEvent(step=step, path=str(path)))
        if self.writer and self.stop_requested:
            self.writer.emit(WarningEvent(step=step, kind="preempted", message=(
                f"stop signal ({', '.join(self.stop.names) or 'on another rank'}) at step {step}: "
                + ("checkpoint saved, run CANCELLED" if saved and self.cancelled() else
                   f"checkpoint saved, run PREEMPTED; continue with `moelab resume {self.run_dir}`" if saved else
                   "run PREEMPTED without a checkpoint (train.save_checkpoints=false)"))))

    def cancelled(self) -> bool:
        """The stop is a cancel (Run.cancel / moelab cancel wrote cancel_requested) or a Ctrl-C: it ends CANCELLED."""
        return self.stop.interrupted or bool(self.folder.read_info().get("cancel_requested"))

    def memory_now(self) -> list[float]:
        """[peak allocated, peak reserved, peak RSS] of this rank in GiB: allocator counters kept on the host,
        so reading them costs no device synchronisation."""
        rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        if not self.env.is_cuda:
            return [0.0, 0.0, rss_gb]
        return [torch.cuda.max_memory_allocated(self.env.device) / 2**30,
                torch.cuda.max_memory_reserved(self.env.device) / 2**30, rss_gb]

    def memory(self) -> dict:
        """This step's memory event: rank 0's figures, the maximum over ranks, and every rank's."""
        keys = ("peak_allocated_gb", "peak_reserved_gb", "rss_gb")
        per_rank = [{"rank": r, **dict(zip(keys, vals))} for r, vals in enumerate(self.last_memory)]
        key = "peak_allocated_gb" if self.env.is_cuda else "rss_gb"
        return {**per_rank[0], "max_peak_allocated_gb": max(r[key] for r in per_rank), "per_rank": per_rank}

    def _report_error(self, e: BaseException) -> None:
        """Every rank that fails appends an error event (with its traceback) to the stream. A run folder that
        cannot be written (disk full, read-only: FolderWriteError, DiskFullError) is its message alone, which
        names the cause, the path and the fix (the traceback stays in the rank's log)."""
        if isinstance(e, (KeyboardInterrupt, SystemExit)):  # SystemExit: submitit requeueing the job
            return
        folder = isinstance(e, (FolderWriteError, DiskFullError))
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            MetricsWriter(self.folder.metrics).emit(ErrorEvent(
                step=self.step, rank=self.env.rank, message=f"{type(e).__name__}: {e}",
                traceback="" if folder else traceback.format_exc()))
        except OSError:
            pass
