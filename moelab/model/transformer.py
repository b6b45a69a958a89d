"""The decoder-only MoE transformer.

Shapes: B batch, L sequence, D hidden, V vocabulary.

Pipeline-friendly in torchtitan's way: ``layers`` is a ModuleDict keyed by the global layer index, and
``tok_embeddings``, ``norm`` and ``output`` may be set to None, so a pipeline stage is this same class with
the parts it does not own removed. No parallelism lives here.
"""
from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from moelab.backends.into_grad import embedding
from moelab.backends.loss import lm_loss
from moelab.config import BackendConfig, ModelConfig
from moelab.model.attention import GQAttention
from moelab.model.batch_context import NO_CONTEXT, BatchContext
from moelab.model.layers import RMSNorm, SwiGLU, rope_cos_sin
from moelab.model.lora import lora_init_std
from moelab.model.moe import MoE
from moelab.layout.shapes import layer_window
from moelab.model.recompute import full_forward, selective_forward


def build_attention(cfg: ModelConfig, backend: BackendConfig, index: int) -> nn.Module:
    if cfg.attention == "mla":
        from moelab.model.mla import MLAttention

        return MLAttention(cfg, backend)
    return GQAttention(cfg, backend, window=layer_window(cfg, index))


class Block(nn.Module):
    """One decoder block: pre-norm attention and pre-norm FFN (dense or MoE by index), residual around each.

        block = Block(cfg.model, cfg.backend, index=1)
        y_BLD = block(x_BLD, cos_LD, sin_LD, BatchContext())
    """
    def __init__(self, cfg: ModelConfig, backend: BackendConfig, index: int):
        super().__init__()
        self.index = index
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = build_attention(cfg, backend, index)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.is_moe = index >= cfg.num_dense_layers
        self.ffn = (MoE(cfg.hidden_size, cfg.moe, backend, cfg.hidden_act) if self.is_moe
                    else SwiGLU(cfg.hidden_size, cfg.dense_ffn_size, cfg.hidden_act))
        # "full" or "selective": moelab.model.recompute (set by train.activation_checkpointing)
        self.recompute = None

    def forward(self, x_BLD, cos_LD, sin_LD, ctx: BatchContext = NO_CONTEXT):
        if self.recompute == "selective":
            return selective_forward(self, x_BLD, cos_LD, sin_LD, ctx)
        if self.recompute == "full":
            return full_forward(self, x_BLD, cos_LD, sin_LD, ctx)
        return self.compute(x_BLD, cos_LD, sin_LD, ctx)

    def compute(self, x_BLD, cos_LD, sin_LD, ctx: BatchContext = NO_CONTEXT, record: dict | None = None):
        """The block without recompute. `record`: a dict that takes the router's statistics instead of its
        buffers (Router.forward; moelab.model.recompute.full_forward)."""
        x_BLD = x_BLD + self.attention(self.attention_norm(x_BLD), cos_LD, sin_LD, ctx.documents_BL)
        h_BLD = self.ffn_norm(x_BLD)
        return x_BLD + (self.ffn(h_BLD, ctx, record) if self.is_moe else self.ffn(h_BLD))


class MoETransformer(nn.Module):
    """The whole decoder: embedding, blocks (a ModuleDict by layer index, so pipeline stages can drop layers),
    final norm, LM head. Pure PyTorch, no parallelism.

        model = MoETransformer(load_config("tiny").model)
        logits_BLV = model(tokens_BL, torch.arange(tokens_BL.shape[1]))
    """
    def __init__(self, cfg: ModelConfig, backend: BackendConfig | None = None):
        super().__init__()
        backend = backend or BackendConfig()
        self.cfg = cfg
        # padding_idx: the pad row gets no gradient, as in transformers (ModelConfig.pad_token_id)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                           padding_idx=cfg.pad_token_id if cfg.pad_token_id >= 0 else None)
        self.layers = nn.ModuleDict({str(i): Block(cfg, backend, i) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rope_dim = cfg.qk_rope_head_dim if cfg.attention == "mla" else cfg.head_dim
        # the head's loss with targets (moelab.backends.loss): backend.loss as the switchboard resolved it, and
        # whether its per-chunk work is compiled (set by moelab.parallel.place.apply_compile)
        # (auto is resolved for the run's device by moelab.backends.apply_backends; a bare model takes chunked)
        self.loss_kind = backend.loss if backend.loss != "auto" else "chunked"
        self.loss_chunk_tokens, self.loss_compiled = backend.loss_chunk_tokens, False

    def forward(self, tokens_or_h: torch.Tensor, positions_L: torch.Tensor | None = None,
                targets_BL: torch.Tensor | None = None, ctx: BatchContext | None = None) -> torch.Tensor:
        """tokens [B, L] -> logits [B, L, V] (or hidden states, for a pipeline stage without the head); with
        `targets_BL`, the mean next-token loss instead of the logits (moelab.backends.loss: the fused loss never
        holds them). `positions_L` defaults to 0..L-1; context parallelism passes the positions of its shard;
        packed sequences (moelab.data.sft) pass [B, L], restarting at each document. `ctx`: the batch's token
        mask, packed documents and loss scale (moelab.model.batch_context; None: none of them)."""
        ctx = NO_CONTEXT if ctx is None else ctx
        h_BLD = embedding(self.tok_embeddings, tokens_or_h) if self.tok_embeddings is not None else tokens_or_h
        if positions_L is None:
            positions_L = torch.arange(h_BLD.shape[1], device=h_BLD.device)
        cos_LD, sin_LD = rope_cos_sin(positions_L, self.rope_dim, self.cfg.rope_theta, h_BLD.dtype,
                                      self.cfg.rope_scaling)
        if positions_L.dim() == 2:  # [B, L, Dh] -> [B, 1, L, Dh]: broadcast over the heads
            cos_LD, sin_LD = cos_LD[:, None], sin_LD[:, None]
        for layer in self.layers.values():
            h_BLD = layer(h_BLD, cos_LD, sin_LD, ctx)
        if self.norm is not None:
            h_BLD = self.norm(h_BLD)
        if self.output is None:
            return h_BLD
        if targets_BL is None:
            return self.output(h_BLD)
        return lm_loss(h_BLD, self.output, targets_BL, self.loss_kind, self.cfg.pad_token_id, self.loss_compiled,
                       self.loss_chunk_tokens, backward_scale=ctx.loss_scale)

    def tie_weights(self) -> None:
        """With tie_embeddings the head IS the embedding (one parameter). Call again after `to_empty`, which
        gives each module its own new tensor; a pipeline stage without the embedding or the head has nothing to tie."""
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.layers.values() if b.is_moe]

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02, select=None, write=None) -> None:
        """Initialise every parameter from a generator seeded by (seed, parameter name): the same weights on
        any device and for any subset of layers, so pipeline stages and sharded builds agree with one process.
        `select(name) -> bool` limits it to some parameters (a start from a checkpoint fills the others);
        `write(param, value)` puts a drawn value (the whole single-process tensor, on the CPU) into a parameter
        (default: copy; moelab.parallel.place passes one that writes a shard's rows)."""
        write = write or (lambda p, value: p.copy_(value.to(p.device, p.dtype)))
        out_std = std / math.sqrt(2 * max(self.cfg.num_layers, 1))
        # Stacked expert tensors [E, ...] are seeded per expert (by global index), so an expert-parallel rank
        # that holds a slice of the experts builds exactly that slice of the single-process tensor.
        first_expert = {f"{mname}.{pname}": m.expert_offset for mname, m in self.named_modules()
                        if hasattr(m, "expert_offset") for pname, _ in m.named_parameters(recurse=False)}
        for name, p in self.named_parameters():
            if p.device.type == "meta" or (select is not None and not select(name)):
                continue
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name.rsplit(".", 2)[-2] or leaf == "sinks":
                p.fill_(1.0 if "norm" in name.rsplit(".", 2)[-2] else 0.0)
                continue
            if leaf == "bias" or leaf.startswith("b_"):  # linear, router and expert biases start at zero
                p.zero_()
                continue
            scale = out_std if any(k in name for k in ("o_proj", "down_proj", "w_down")) else std
            adapter_std = lora_init_std(leaf, p.shape)  # LoRA: B = 0 (the base model at step 0), A ~ 1/sqrt(fan in)
            scale = scale if adapter_std is None else adapter_std
            if name in first_expert:
                e0 = first_expert[name]
                full = torch.stack([_seeded_randn(p.shape[1:], seed, f"{name}[{e0 + e}]") for e in range(p.shape[0])])
            else:
                full = _seeded_randn(p.shape, seed, name)
            value = full * scale
            if name == "tok_embeddings.weight" and self.cfg.pad_token_id >= 0:  # as transformers initialises it
                value[self.cfg.pad_token_id] = 0.0
            write(p, value)
        for moe in self.moe_layers():
            moe.router.reset_buffers()


def _seeded_randn(shape, seed: int, key: str) -> torch.Tensor:
    """Standard normal values from a CPU generator seeded by (seed, key): the same on every device."""
    g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.randn(tuple(shape), generator=g)
