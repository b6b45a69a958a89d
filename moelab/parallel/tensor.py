"""Tensor parallelism (parallel.tp) with DTensor, applied to a model that has none (torchtitan's plan).

    apply_tensor_parallel(model_on_meta, cfg, meshes)   # before EP and FSDP2 (moelab.parallel.distributed)

Shapes: B batch, L sequence, Lr = L / tp this rank's sequence share, D hidden, V vocabulary.

The residual stream is sequence-parallel: between the sublayers each TP rank holds Lr positions of every
sequence (a DTensor Shard(1)), so the norms run on a share of the tokens (SequenceParallel, weights replicated).

- Embedding: vocabulary-parallel (RowwiseParallel: each rank looks up its vocabulary rows, the partial sums are
  reduce-scattered to sequence shards).
- Attention: the input is all-gathered (PrepareModuleInput), q/k/v column-parallel (each rank computes
  num_heads / tp query heads and num_kv_heads / tp key/value heads: the model reshapes by -1 heads), o row-
  parallel, reduce-scattered back to sequence shards. QK norms act per head: their weights are replicated and
  their gradients summed over the heads of all ranks (SequenceParallel over the heads dimension). GPT-OSS's sink
  logits are sharded with the heads. MLA: the query and kv up-projections column-parallel by heads, the latent
  down-projections and their norms repeated on every rank (RepeatedPerHeads).
- Dense MLPs: gate/up column-parallel, down row-parallel, between the same gather and reduce-scatter.
- MoE layers take the sequence shard as plain tokens: each TP rank routes its own Lr tokens like a
  data-parallel rank (the router replicated, routed experts on EP carved from dp*cp*tp, moelab.layout.dims). The
  parameters of the layer (router, experts, shared experts) are FSDP2-sharded over all the ranks that route
  (moelab.parallel.fsdp), and their gradients are scaled by tp (``_moe_gradients``): FSDP2 averages over the
  dp*cp*tp ranks where the TP ranks' shares of one loss must add. The routers' loss means are taken over the
  cp*tp ranks of each sequence (``set_token_means``), so the aux loss is the one-process value. Shared experts
  (parallel.tp_shared_experts): replicate (default) runs them there too, whole on the rank's tokens, their
  weights FSDP2-sharded over the dp*cp*tp ranks: no collective; column_row runs them column/row-parallel
  between an all-gather of the TP group's tokens and a reduce-scatter (``_shard_shared_experts``; an FSDP2 unit
  of their own over dp*cp): the same FLOPs per rank and 4 more collectives per MoE layer and micro batch, for
  FSDP2 gathering a tp-th of their weights (docs/layouts.md counts both on DeepSeek-V3: replicate pays).
- Routed experts are EP's, split by expert over ranks that include the TP ranks; no expert TP (docs/layouts.md:
  it doubles the all-to-all and saves no memory while ep can grow).
- Pipeline stages pass this rank's plain sequence shard between ranks (``sequence_shard_boundaries``).
- LoRA (train.lora): a column-parallel base's adapters A replicated, B column-parallel; a row-parallel base's A
  row-parallel, B replicated (``_shard_adapters``); the routed experts' grouped adapters follow EP.
- Selective recompute (moelab.model.recompute) runs inside the MoE layer's call, so the hooks above wrap the router
  and the recomputed rest alike; the fake balanced gate counts this rank's tokens at their positions in the
  whole sequence (``count_whole_sequences``), so each token meets the experts it meets on one process.
- Replicated experts (parallel.expert_dp=replicate) average their gradients over the expert-FSDP ranks (which hold
  the TP ranks) where FSDP2 would reduce-scatter them: the same x tp scaling applies.
- train.compile compiles each block after this placement (torchtitan's order: moelab.parallel.place.apply_compile):
  dynamo traces the DTensor block, its sequence collectives included.
- LM head: vocabulary-parallel (column-parallel, logits stay a DTensor sharded on V) and the loss computed on the
  sharded logits, or (backend.loss=chunked) on the head's rows chunk by chunk (moelab.backends.vocab_parallel):
  no rank holds [B, L, V].
- Padding (model.pad_token_id): the embedding's pad row gets no gradient (DTensor's embedding backward runs over
  the whole vocabulary with nn.Embedding's global padding_idx, then each rank keeps its rows); the MoE layer
  takes its sequence shard's columns of the token mask (``_sequence_share``) and the routers' masked means
  divide by the count over the ranks of the sequence (moelab.model.router).
- Packed SFT batches: the attention gathers the whole sequence, whose document ids and positions it takes as
  they are; the MoE layer and the loss take its masks as they take padding's.
- Not yet: FP8 and TE attention (GPU-only: several GPUs to build and prove them), DDP (FSDP2's 2-D mesh
  instead), the library fused losses (liger, cce: the whole vocabulary on one GPU) (moelab.config.rules refuses
  each by name, with the reason).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from moelab.config import Config
from moelab.model.batch_context import BatchContext
from moelab.model.lora import LoRALinear
from moelab.model.mla import MLAttention
from moelab.parallel.context import mean_over_ranks
from moelab.parallel.expert_parallel import _ScaleGrad
from moelab.parallel.mesh import Meshes


def _gathered(n_args: int) -> PrepareModuleInput:
    """All-gather the sequence shards of a sublayer's first argument; the others (rotary tables, documents)
    pass as they are."""
    return PrepareModuleInput(input_layouts=(Shard(1),) + (None,) * (n_args - 1),
                              desired_input_layouts=(Replicate(),) + (None,) * (n_args - 1))


class _ReplicatedPartialGrad(torch.autograd.Function):
    """A local tensor that every TP rank holds whole, as a Replicate DTensor whose gradient comes back as this
    rank's partial sum (not all-reduced): the input of a computation each rank repeats for its own heads."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return DTensor.from_local(x, mesh, (Replicate(),), run_check=False)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):
            grad = grad.redistribute(ctx.mesh, (Partial(),)).to_local()
        return grad, None


def _partial_input(x, mesh):
    """`x` (local, or a Replicate DTensor) as a Replicate DTensor whose gradient stays this rank's partial sum."""
    if isinstance(x, DTensor):
        x = x.to_local(grad_placements=(Partial(),))
    return _ReplicatedPartialGrad.apply(x, mesh)


class RepeatedPerHeads(ParallelStyle):
    """A module every TP rank computes whole (MLA's low-rank projections and their norms) for its own heads:
    weights replicated, and their gradients and the input's summed over the ranks (Partial), since each rank's
    backward holds only its heads' share (torchtitan's NoParallel, with the sums left partial).

        parallelize_module(attention, meshes.tp, {"kv_a_proj": RepeatedPerHeads(), "kv_b_proj": ColwiseParallel()})
    """

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        return distribute_module(
            module, mesh, None,
            input_fn=lambda mod, inputs, m: tuple(_partial_input(x, m) if isinstance(x, torch.Tensor) else x
                                                  for x in inputs),
            output_fn=lambda mod, out, m: out.to_local(grad_placements=(Partial(),)))


def _mla_plan(attention: nn.Module, mesh) -> dict:
    """MLA: query (q_proj, or q_b_proj after the low-rank q_a) and key/value up-projection kv_b column-parallel by
    heads; the latent projections q_a/kv_a and their norms repeated on every rank (RepeatedPerHeads); the shared
    rotary key is a slice of kv_a's output, used by each rank's heads."""
    for name in ("q_b_proj", "kv_b_proj", "q_proj"):
        up = getattr(attention, name, None)
        if up is not None:  # its input (a repeated latent) keeps a partial gradient; registered before TP's hooks
            up.register_forward_pre_hook(lambda mod, args: (_partial_input(args[0], mesh),) + tuple(args[1:]))
    plan = {"kv_a_proj": RepeatedPerHeads(), "kv_a_norm": RepeatedPerHeads(), "kv_b_proj": ColwiseParallel(),
            "o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    if attention.q_proj is not None:
        plan["q_proj"] = ColwiseParallel()
    else:
        plan.update(q_a_proj=RepeatedPerHeads(), q_a_norm=RepeatedPerHeads(), q_b_proj=ColwiseParallel())
    return plan


def _attention_plan(attention: nn.Module, mesh) -> dict:
    if isinstance(attention, MLAttention):
        return _mla_plan(attention, mesh)
    plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
            "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    if attention.q_norm is not None:  # [B, L, heads, Dh]: the local heads of a replicated norm
        plan["q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _shard_sinks(attention: nn.Module, mesh) -> None:
    """GPT-OSS's per-head sink logits [H] sharded with the heads (Shard(0)); the attention reads them as a plain
    tensor of its own heads: during its forward the parameter's local shard stands in for it (after FSDP2's
    gather, which runs on the enclosing block), and the parameter is put back after."""
    attention.sinks = nn.Parameter(distribute_tensor(attention.sinks, mesh, (Shard(0),)))

    held = {}  # the parameter, while its local shard stands in

    def pre_hook(module, args):
        held["sinks"] = module._parameters["sinks"]
        module._parameters["sinks"] = held["sinks"].to_local()

    def post_hook(module, args, output):
        module._parameters["sinks"] = held.pop("sinks")

    attention.register_forward_pre_hook(pre_hook)
    attention.register_forward_hook(post_hook)


def _mlp_plan() -> dict:
    return {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
            "down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}


def _sequence_share(ctx: BatchContext, x_BLD: DTensor) -> BatchContext:
    """The batch context of this rank's sequence shard of `x_BLD` (a DTensor Shard(1)): the token mask's columns
    of its positions (padding stays out of the router's losses and counts on every rank)."""
    if ctx.token_mask_BL is None:
        return ctx
    (_, Lr, _), (_, start, _) = compute_local_shape_and_global_offset(x_BLD.shape, x_BLD.device_mesh,
                                                                       x_BLD.placements)
    return dataclasses.replace(ctx, token_mask_BL=ctx.token_mask_BL[:, start:start + Lr])


def _moe_gradients(moe: nn.Module, tp_mesh) -> None:
    """The MoE layer between sequence-parallel DTensors: its input as this rank's plain tokens (and its batch
    context's token mask as their columns), its output back as a sequence shard; its parameters' gradients x tp
    (the TP ranks' token shares of one loss add up, FSDP2 averages), its input's gradient unchanged."""
    tp = tp_mesh.size()

    def pre_hook(module, args):
        x_BLrD, rest = args[0], tuple(args[1:])
        if isinstance(x_BLrD, DTensor):
            rest = (_sequence_share(rest[0], x_BLrD),) + rest[1:] if rest else rest
            x_BLrD = x_BLrD.to_local()
        return (_ScaleGrad.apply(x_BLrD, 1.0 / tp),) + rest

    def post_hook(module, args, y_BLrD):
        return DTensor.from_local(_ScaleGrad.apply(y_BLrD, float(tp)), tp_mesh, (Shard(1),), run_check=False)

    moe.register_forward_pre_hook(pre_hook)
    moe.register_forward_hook(post_hook)


def _shard_shared_experts(shared: nn.Module, tp_mesh) -> None:
    """parallel.tp_shared_experts=column_row: the shared experts as a dense MLP over TP inside the MoE layer. Their
    input, this rank's tokens [T, D] (the layer's plain sequence shard, flattened), is all-gathered to the TP
    group's tokens (Shard(0) -> Replicate: rank-major, any token order serves a per-token MLP), gate/up column-,
    down row-parallel, the partial sums reduce-scattered back to this rank's tokens. Their weights' gradients
    are then sums over the TP group's tokens, as a dense MLP's, where the MoE layer's are x tp
    (``_moe_gradients``): the gradient is divided by tp on the way in and restored on the way out."""
    tp = tp_mesh.size()
    shared.register_forward_pre_hook(lambda mod, args: (_ScaleGrad.apply(args[0], float(tp)),) + tuple(args[1:]))
    shared.register_forward_hook(lambda mod, args, y_TD: _ScaleGrad.apply(y_TD, 1.0 / tp))
    parallelize_module(shared, tp_mesh, PrepareModuleInput(input_layouts=(Shard(0),),
                                                           desired_input_layouts=(Replicate(),)))
    parallelize_module(shared, tp_mesh, {**_mlp_plan(), "down_proj": RowwiseParallel(output_layouts=Shard(0))})


def count_whole_sequences(router: nn.Module, tp_mesh) -> None:
    """The fake balanced gate's round robin (moelab.model.router) over the positions of whole sequences: this
    rank's Lr tokens of row b are the tokens b*L + rank*Lr + i of one process's count (L = tp*Lr), so TP routes
    every token as one process does."""
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()

    def token_index(B, Lr, device):
        row_B1, i_1Lr = torch.arange(B, device=device)[:, None], torch.arange(Lr, device=device)[None, :]
        return (row_B1 * (tp * Lr) + rank * Lr + i_1Lr).reshape(-1)

    router.token_index = token_index


def set_token_means(model: nn.Module, tokens_mesh) -> None:
    """The routers' loss means over every rank holding a share of the same sequences (the cp*tp ranks of a
    data-parallel rank; after CP's own, which covers its ranks only)."""
    group, size = tokens_mesh.get_group(), tokens_mesh.size()
    for moe in model.moe_layers():
        moe.router.token_mean = lambda x: mean_over_ranks(x, group, size)


def apply_tensor_parallel(model: nn.Module, cfg: Config, meshes: Meshes) -> None:
    """Shard the meta-device `model` (or pipeline stage) over meshes.tp, in place (see the module docstring)."""
    tp = meshes.tp
    # torch's styles register new parameters, some trainable whatever the old one was (SequenceParallel's and
    # distribute_module's replicated ones): LoRA's frozen base (moelab.model.lora) is frozen again after them
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    if model.tok_embeddings is not None:
        parallelize_module(model.tok_embeddings, tp, RowwiseParallel(input_layouts=Replicate(),
                                                                     output_layouts=Shard(1), use_local_output=False))
    for block in model.layers.values():
        parallelize_module(block, tp, {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block.attention, tp, _gathered(4))
        parallelize_module(block.attention, tp, _attention_plan(block.attention, tp))
        if block.attention.sinks is not None:
            _shard_sinks(block.attention, tp)
        if block.is_moe:
            _moe_gradients(block.ffn, tp)
            if block.ffn.shared_experts is not None and cfg.parallel.tp_shared_experts == "column_row":
                _shard_shared_experts(block.ffn.shared_experts, tp)
            count_whole_sequences(block.ffn.router, tp)
        else:
            parallelize_module(block.ffn, tp, _gathered(1))
            parallelize_module(block.ffn, tp, _mlp_plan())
    if model.norm is not None:
        parallelize_module(model.norm, tp, SequenceParallel())
    if model.output is not None:
        parallelize_module(model.output, tp, ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                             use_local_output=False))
    _shard_adapters(model, tp)
    model.tie_weights()  # tied: the head IS the embedding again (both sharded by vocabulary rows, Shard(0))
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)


def _shard_adapters(model: nn.Module, mesh) -> None:
    """LoRA adapters (moelab.model.lora.LoRALinear, on the meta device) placed by their base's placement:
    column-parallel (weight Shard(0)): A [R, I] replicated, B [O, R] by output rows; row-parallel (Shard(1)): A
    by input columns, B replicated (its input, x A^T, is a partial sum until the base's reduce-scatter); a
    replicated base (RepeatedPerHeads) has replicated adapters already."""
    adapter_placements = {Shard(0): {"lora_A": Replicate(), "lora_B": Shard(0)},
                          Shard(1): {"lora_A": Shard(1), "lora_B": Replicate()}}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not (isinstance(module, LoRALinear) and isinstance(weight, DTensor)):
            continue
        for name, placement in adapter_placements.get(weight.placements[0], {}).items():
            p = getattr(module, name)
            meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
            module.register_parameter(name, nn.Parameter(distribute_tensor(meta, mesh, (placement,)),
                                                         requires_grad=p.requires_grad))


def place_tp_gradients(model: nn.Module, tp_mesh) -> None:
    """Gradients of the parameters left on the TP mesh alone (no FSDP2 unit took them: a one-rank dense mesh)
    placed as their parameters: autograd leaves a replicated weight fed by sequence shards (the norms) with a
    Partial gradient, and the vocabulary-parallel embedding with a Replicate one; the optimizer and the gradient
    norm read local shards, so each is redistributed (all-reduce, local slice) after it is accumulated."""
    def hook(p):
        if p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)

    for p in model.parameters():
        if isinstance(p, DTensor) and p.requires_grad and p.device_mesh == tp_mesh:
            p.register_post_accumulate_grad_hook(hook)


def sequence_shard_boundaries(stage: nn.Module, tp_mesh) -> None:
    """A pipeline stage's hidden-state input and output as plain tensors (this rank's sequence shard
    [B, Lr, D]: what torch's pipeline schedule sends between ranks), DTensors Shard(1) inside the stage."""
    if stage.tok_embeddings is None:
        def pre_hook(module, args):
            h_BLrD = args[0]
            return (DTensor.from_local(h_BLrD, tp_mesh, (Shard(1),), run_check=False),) + tuple(args[1:])

        stage.register_forward_pre_hook(pre_hook)
    if stage.output is None:
        stage.register_forward_hook(lambda module, args, h_BLD: h_BLD.to_local())
