"""Pipeline parallelism on torch.distributed.pipelining: stages by layers, 1F1B or interleaved 1F1B schedules.

    split = stage_layers(model_cfg, num_stages=4)      # moelab.planner.stages: layer indices of every stage
    stages = build_stage_modules(model_on_meta, split, stage_ids=[0, 2])   # this rank's stages (looped)
    runner = PipelineRunner(stages, stage_ids, num_stages, pp_group, device, cfg, n_microbatches)
    runner.infer_shapes(PipelineModel(stages, num_layers), batch_size, seq_len, device)   # once, at setup
    loss_sum = runner.forward_backward(inputs_BL, targets_BL, ctx)   # trainer hook: runs the step's micro batches

A stage is the same MoETransformer with the parts it does not own removed (moelab.model's ModuleDict layout):
the first stage keeps the embedding, the last the final norm and the head. There are pp * vp stages; rank r
holds stages r, r + pp, r + 2pp, ... (the looped placement the interleaved schedule expects). Layers are split
into contiguous stages balancing the matmul cost (activated parameters per layer, the LM head counted on the
last stage), so a dense layer weighs less than a MoE layer.

The last stage computes its micro batch's loss itself (the targets go to the stages as a keyword argument:
MoETransformer.forward with targets, the fused LM-head loss).
The loss of a micro batch is divided by the number of micro batches inside the loss function (scale_grads off),
so gradients, and the router losses attached with BatchContext.loss_scale, have the same scale as the
single-process gradient accumulation. The BatchContext reaches every stage as a keyword argument of the schedule's
step, replicated over the micro batches (it holds no per-row tensor here: no token mask, no packed documents).
``PipelineModel`` presents this rank's stages as one module with the single-process parameter names (for the
optimizer, checkpoints and statistics).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from moelab.config import Config
from moelab.model.batch_context import NO_CONTEXT, BatchContext


def build_stage_modules(model: nn.Module, split: list[list[int]], stage_ids: list[int]) -> list[nn.Module]:
    """One pruned copy of `model` (on the meta device) per stage id: its layers, plus the embedding on the
    first stage and the final norm and head on the last."""
    stages = []
    for k, s in enumerate(stage_ids):
        stage = model if k == len(stage_ids) - 1 else copy.deepcopy(model)
        keep = {str(i) for i in split[s]}
        for key in [key for key in stage.layers if key not in keep]:
            del stage.layers[key]
        if s != 0:
            stage.tok_embeddings = None
        if s != len(split) - 1:
            stage.norm = stage.output = None
        stages.append(stage)
    return stages


class PipelineModel(nn.Module):
    """This rank's stages as one module, with the single-process parameter names ("layers.5.ffn...").
    It only holds the parameters; the schedule runs the stages.

        model = PipelineModel(stages, cfg.model.num_layers); model.moe_layers()
    """

    def __init__(self, stages: list[nn.Module], num_layers: int):
        super().__init__()
        held = {key: block for stage in stages for key, block in stage.layers.items()}
        self.layers = nn.ModuleDict({key: held[key] for key in sorted(held, key=int)})
        firsts = [s.tok_embeddings for s in stages if s.tok_embeddings is not None]
        lasts = [s for s in stages if s.output is not None]
        self.tok_embeddings = firsts[0] if firsts else None
        self.norm = lasts[0].norm if lasts else None
        self.output = lasts[0].output if lasts else None
        self.num_layers = num_layers

    def moe_layers(self) -> list:
        return [b.ffn for b in self.layers.values() if b.is_moe]

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline-parallel model runs through its schedule (PipelineRunner), not forward()")


class PipelineRunner:
    """The schedule of this rank's stages, and the trainer's forward/backward over a step's micro batches.

        runner = PipelineRunner(stages, [rank], pp, group, device, cfg, n_micro)
        loss_sum = runner.forward_backward(inputs_BL, targets_BL)
    """

    def __init__(self, stages: list[nn.Module], stage_ids: list[int], num_stages: int, group, device,
                 cfg: Config, n_microbatches: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        # the last stage's output is already its loss (moelab.backends.loss)
        self.n_microbatches = n_microbatches
        self.holds_first, self.holds_last = 0 in stage_ids, num_stages - 1 in stage_ids
        pipe_stages = [PipelineStage(m, s, num_stages, torch.device(device), group=group)
                       for m, s in zip(stages, stage_ids)]
        kind = cfg.parallel.pp_schedule
        if len(pipe_stages) > 1:  # vp > 1: interleaved 1F1B (moelab.layout.dims.ParallelDims)
            self.schedule = ScheduleInterleaved1F1B(pipe_stages, n_microbatches, loss_fn=self.loss_fn,
                                                    scale_grads=False)
        else:
            cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
            self.schedule = cls(pipe_stages[0], n_microbatches, loss_fn=self.loss_fn, scale_grads=False)
        if not self.skips_outputs:
            raise RuntimeError(f"torch {torch.__version__}'s pipeline schedules merge the last stage's outputs, which "
                               "are the model's scalar losses here; moelab needs a torch whose schedule.step takes "
                               "return_outputs (torch >= 2.11)")

    @property
    def skips_outputs(self) -> bool:
        """Whether the schedule can skip merging the last stage's outputs (torch's `step(return_outputs=False)`);
        the model's own loss needs it (scalar losses do not concatenate), logits merely cost memory."""
        import inspect

        return "return_outputs" in inspect.signature(self.schedule.step).parameters

    def infer_shapes(self, model: nn.Module, batch_size: int, seq_len: int, device) -> None:
        """Run one step on zeros and discard its effects. torch.distributed.pipelining learns the shapes passed
        between stages by running the stages on its first step (how, depends on the torch release); that extra
        forward would add to the routers' statistics of the first training step. Afterwards: no gradients, and
        every router's statistics reset."""
        zeros_BL = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        self.forward_backward(zeros_BL, zeros_BL)
        model.zero_grad(set_to_none=True)
        for moe in model.moe_layers():
            moe.router.pop_stats()

    def loss_fn(self, output: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
        """One micro batch's loss, pre-divided by the number of micro batches (gradient accumulation)."""
        return output / self.n_microbatches

    def forward_backward(self, inputs_BL: torch.Tensor, targets_BL: torch.Tensor,
                         ctx: BatchContext = NO_CONTEXT) -> torch.Tensor:
        """Run this rank's share of the step (all its micro batches, concatenated along the batch); returns
        the summed micro-batch losses on the rank holding the last stage, zero elsewhere. `ctx` (the loss scale)
        goes to every stage's forward: per-row tensors in it would not be split over the micro batches."""
        if ctx.token_mask_BL is not None or ctx.documents_BL is not None:
            raise NotImplementedError("pipeline parallelism passes no token mask or packed documents yet")
        losses: list[torch.Tensor] = []
        # Only the first stage takes the inputs (the others receive activations), and contiguous ones: torch
        # 2.11 asserts that later stages get none when it infers the shapes passed between stages, and checks
        # each micro batch's strides against those it saw then (tests/parallel/test_pipeline.py).
        inputs = (inputs_BL.contiguous(),) if self.holds_first else ()
        targets_BL = targets_BL.contiguous() if self.holds_last else None
        # the model computes the loss: every stage takes the targets (only the last uses them)
        kwargs = {"targets_BL": targets_BL}
        if self.skips_outputs:  # the merge of the last stage's outputs: not needed, and scalars do not concatenate
            kwargs["return_outputs"] = False
        self.schedule.step(*inputs, target=targets_BL, losses=losses, ctx=ctx, **kwargs)
        if not self.holds_last:
            return torch.zeros((), device=inputs_BL.device)
        return torch.stack([l.detach() for l in losses]).sum() * self.n_microbatches
