"""The optimizer step overlapped with the next forward (train.optimizer_overlap=auto, one CUDA process).

On one GPU the optimizer is a long memory-bound pass after the backward (AdamW over the Qwen3 proxy's 5.6 B bf16
parameters: 26 ms on an H100, a fifth of a one-micro-batch step), and the next forward waited for all of it. Here
it runs on a side stream in the forward's order, one stage at a time: the parameters used before the blocks (the
token embedding), then each block's, then those used after them (the final norm, the LM head). Each stage ends
with an event; the main stream waits for a stage's event just before the forward first uses it (forward pre-hooks
on the model, each block and the final norm), so the forward of block i may start before block i+1's update ends.

Measured (issue 41 call 25, one H100, gallery/perf-notes.md): 0.5% at global batch 2 and 1.0% at 16, within the
run-to-run spread at 2. Both streams have the same priority, and the GPU's block scheduler ran the update's queued
blocks mostly before the forward's kernels: the overlap is in the launch gaps, not beside the GEMMs. Call 26
ran the step on a higher-priority stream than the update (same model, same call): 121.7 / 794.1 ms a step at global
batch 2 / 16 against 121.9 / 793.9 at one priority. The forward's kernels leave the update no SMs either way, so
the streams keep one priority.

The update is the optimizer's own, per element: staging it only hides the other stages' gradients from each call,
so the weights and moments are bitwise those of one optimizer.step() (tests/train/test_overlap.py; on the GPU
gallery/scripts/gpu_check_overlap.py). A stage's gradients are freed as soon as its update is queued, their memory
held until the side stream has read them (record_stream).

Where it applies (``OptimizerOverlap.attach``): CUDA, one process (no process group: FSDP2, DDP and expert
parallelism reduce or reshard gradients on their own streams), no pipeline, train.optimizer_overlap=auto. Anything
that reads or writes the weights outside a forward calls ``join()`` first (the trainer: checkpoints, the FP8
weight cache, evaluation and expert-token records, the run's end); with per-expert learning rates
(moelab.train.expert_lr rescales the update right after it) the trainer steps on its own stream.

    overlap = OptimizerOverlap.attach(model, optimizer, cfg, world_size=1)   # None where it does not apply
    overlap.step()     # in place of optimizer.step(): queued on the side stream, stage by stage
    overlap.join()     # the current stream waits for the whole update
"""
from __future__ import annotations

import torch
from torch import nn

from moelab.config import Config


def stages(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """The optimizer's parameters in the forward's order: [before the blocks, block 0, ..., block n-1, after the
    blocks (the final norm and the LM head)]. A weight tied to the embedding counts as the embedding's."""
    layers = getattr(model, "layers", None) or {}
    owner: dict[int, int] = {}
    for i, block in enumerate(layers.values()):
        for p in block.parameters():
            owner[id(p)] = i + 1
    embedding = getattr(model, "tok_embeddings", None)
    first = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    last = len(layers) + 1
    for name in ("norm", "output"):
        module = getattr(model, name, None)
        if module is not None:
            for p in module.parameters():
                owner.setdefault(id(p), 0 if id(p) in first else last)
    out: list[list[torch.Tensor]] = [[] for _ in range(last + 1)]
    for group in optimizer.param_groups:
        for p in group["params"]:
            out[owner.get(id(p), 0)].append(p)
    return out


@torch.no_grad()
def staged_step(optimizer: torch.optim.Optimizer, stages: list[list[torch.Tensor]], done=None) -> None:
    """optimizer.step() one stage at a time: each call sees only that stage's gradients (the others are hidden),
    so every parameter is updated once, as by one step. After a stage, its gradients are released (.grad None)
    and `done(stage, its gradients)` is called; the stage's gradients are freed before the next stage is queued
    (with record_stream in `done`, their memory returns after that stage's update). Every gradient is None
    afterwards."""
    held = [[(p, p.grad) for p in ps if p.grad is not None] for ps in stages]
    for ps in stages:
        for p in ps:
            p.grad = None
    for i in range(len(held)):
        pairs, held[i] = held[i], []  # this stage's gradients die with `pairs`, once it is queued
        if not pairs:
            continue
        for p, g in pairs:
            p.grad = g
        optimizer.step()
        for p, g in pairs:
            p.grad = None
        if done is not None:
            done(i, [g for _, g in pairs])
        del pairs, p, g


def wait_points(model: nn.Module, n_stages: int) -> list[tuple[nn.Module, tuple[int, ...]]]:
    """Where the forward waits for which stages (of ``stages``): the model's forward for the first, each block's
    for its own, the final norm's for the last (with the first where there is no final norm)."""
    blocks = list((getattr(model, "layers", None) or {}).values())
    last = n_stages - 1
    norm = getattr(model, "norm", None)
    points = [(model, (0,) if norm is not None else (0, last))]
    points += [(block, (i + 1,)) for i, block in enumerate(blocks)]
    if norm is not None:
        points.append((norm, (last,)))
    return points


def applies(cfg: Config, world_size: int, on_cuda: bool, pipeline: bool) -> bool:
    """Whether the overlap runs: train.optimizer_overlap=auto on one CUDA process without a pipeline."""
    return cfg.train.optimizer_overlap == "auto" and on_cuda and world_size == 1 and not pipeline


class OptimizerOverlap:
    """The optimizer's step on a side stream, stage by stage, waited for by the forward (module docstring). On
    the CPU (the tests) torch.cpu's streams and events are no-ops: the same calls, run in order.

        overlap = OptimizerOverlap(model, optimizer)
        loss.backward(); overlap.step(); optimizer.zero_grad(set_to_none=True)
        model(tokens)                                  # waits for each stage as it reaches it
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.stages = stages(model, optimizer)
        self.device = next(p.device for ps in self.stages for p in ps)
        self.streams = torch.get_device_module(self.device.type)  # torch.cuda, or torch.cpu's no-op streams
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else self.streams.Stream()
        self.events: list = [None] * len(self.stages)
        self.handles = [module.register_forward_pre_hook(self._hook(waits))
                        for module, waits in wait_points(model, len(self.stages))]

    @classmethod
    def attach(cls, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config, world_size: int,
               pipeline: bool = False) -> "OptimizerOverlap | None":
        """An OptimizerOverlap where it applies (``applies``), else None (the trainer calls optimizer.step())."""
        on_cuda = any(p.is_cuda for g in optimizer.param_groups for p in g["params"])
        return cls(model, optimizer) if applies(cfg, world_size, on_cuda, pipeline) else None

    def _hook(self, waits: tuple[int, ...]):
        @torch.compiler.disable  # the blocks are compiled with their hooks: the wait stays a host call
        def wait(module, args):
            for stage in waits:
                self._wait(stage)

        return wait

    def _wait(self, stage: int) -> None:
        event, self.events[stage] = self.events[stage], None  # the first wait orders all later work
        if event is not None:
            self.streams.current_stream(self.device).wait_event(event)

    @torch.no_grad()
    def step(self) -> None:
        """optimizer.step() on the side stream, stage by stage, after the current stream's work (the gradients,
        clipped); each stage's gradients are released once its update is queued."""
        self.join()  # a stage no forward has waited for since the last step (none in a plain loop)
        self.stream.wait_stream(self.streams.current_stream(self.device))

        def done(i: int, grads: list) -> None:
            if self.device.type == "cuda":
                for g in grads:  # freed by staged_step, their memory reused only after the side stream read them
                    g.record_stream(self.stream)
            self.events[i] = self.streams.Event()
            self.events[i].record(self.stream)

        with self.streams.stream(self.stream):
            staged_step(self.optimizer, self.stages, done)

    def join(self) -> None:
        """The current stream waits for every stage not yet waited for (before reading the weights or the
        optimizer's state outside a forward)."""
        for i in range(len(self.events)):
            self._wait(i)

    def remove(self) -> None:
        """Join, then take the forward hooks off."""
        self.join()
        for h in self.handles:
            h.remove()
