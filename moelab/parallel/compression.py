"""The gradient exchange of replicated experts (parallel.expert_dp=replicate): a mean over the expert data-parallel
ranks after backward, exact or 1-bit (train.expert_grad_compression=sign).

Shapes: X local experts, N elements of one expert's slice of a stacked parameter, W ranks holding the same
experts, B = ceil(X*N / 8) bytes of packed signs.

    exchange = ExpertGradExchange(named_expert_params, group, mode="sign")
    exchange.overlap_with_backward()          # optional: launch from gradient hooks while backward runs
    exchange.armed = True; loss.backward(); exchange.reduce()   # every rank's expert .grad is the mean
    exchange.pop()                            # {"expert_grad_bytes": [...], "expert_grad_uncompressed_bytes": [...]}

1-bit compression (the seed's sign(g) * mean(|g|), with error feedback as in 1-bit SGD / EF-signSGD):
  1. c = g + e, with e this rank's residual from the previous step (zeros at first);
  2. one scale per expert, s_x = mean(|c_x|) over the expert's N elements, and the signs of c packed 8 to a byte
     (torch has no bit tensor: a uint8 view of 8 sign bits, ``pack_signs``); sign(0) counts as +;
  3. e <- c - s * sign(c): what this step did not send is sent later (the residual stays on this rank);
  4. all ranks all-gather the packed signs and scales (B + 4X bytes per rank), decode each rank's s * sign and
     average them.
Why per expert: a stacked parameter holds X experts whose gradients scale with the tokens each received (a busy
expert's are many times an idle one's), so one scale per stacked tensor would give idle experts the busy ones'
step size; each expert's slice is the tensor the seed (one nn.Module per expert) scales. The 4 bytes per expert
are negligible next to N/8. Why all_gather: signs cannot be summed in 1-bit form, so an all-reduce would need
wider words; gathering every rank's bits sends (W-1)(B + 4X) bytes per rank against a ring all-reduce's
2(W-1)/W * 4XN: 64/W times fewer, a saving up to 64 ranks (a two-phase compressed reduce-scatter + all-gather,
as 1-bit Adam does, would keep the saving at any W at the cost of a second error-feedback buffer).
The residuals are per rank and saved with checkpoints (``state_dict``), so a resume continues exactly.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(x_N: torch.Tensor) -> torch.Tensor:
    """[N] -> [ceil(N/8)] uint8: bit i of the output is x[i] >= 0, most significant bit first.

        unpack_signs(pack_signs(torch.tensor([-1., 2., 0.])), 3)   # tensor([-1., 1., 1.])
    """
    bits_N = (x_N.reshape(-1) >= 0).to(torch.uint8)
    bits_N = torch.nn.functional.pad(bits_N, (0, (-bits_N.numel()) % 8))
    return (bits_N.view(-1, 8) * _BIT_WEIGHTS.to(x_N.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed_B: torch.Tensor, n: int, dtype=torch.float32) -> torch.Tensor:
    """The inverse of pack_signs: [B] uint8 -> [n] of +1 / -1."""
    bits = packed_B[:, None].bitwise_and(_BIT_WEIGHTS.to(packed_B.device)).ne(0).reshape(-1)[:n]
    return bits.to(dtype) * 2 - 1


def compress(c_XN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed signs [B] uint8, scales [X] fp32 = mean |c| per expert) of a [X, N] gradient."""
    return pack_signs(c_XN), c_XN.float().abs().mean(1)


def decompress(packed_B: torch.Tensor, scale_X: torch.Tensor, shape) -> torch.Tensor:
    X = scale_X.numel()
    signs_XN = unpack_signs(packed_B, X * (int(torch.Size(shape).numel()) // X)).view(X, -1)
    return (signs_XN * scale_X[:, None]).view(shape)


def error_feedback_step(g_XN: torch.Tensor, e_XN: torch.Tensor | None):
    """(packed signs, scales, the new residual) for gradient g and residual e (None: zeros): c = g + e is sent
    as compress(c), and what it missed, c - decompress(...), is the new residual. Where that is not finite (a NaN
    gradient, whose step train.on_nan=skip skips) the old residual stays, so one bad step cannot poison the rest."""
    old_XN = torch.zeros_like(g_XN, dtype=torch.float32) if e_XN is None else e_XN
    c_XN = g_XN.float() + old_XN
    packed_B, scale_X = compress(c_XN)
    new_XN = c_XN - decompress(packed_B, scale_X, c_XN.shape)
    return packed_B, scale_X, torch.where(torch.isfinite(new_XN), new_XN, old_XN)


class ExpertGradExchange:
    """Averages the gradients of replicated expert parameters over `group` after backward: ``reduce()``.
    mode "none" all-reduces them exactly; "sign" sends 1-bit signs and one scale per expert with error feedback
    (module docstring). Counts the bytes each call sends from this rank (``pop``).

        ex = ExpertGradExchange([("layers.1.ffn.experts.w_gate_up", p)], group, mode="sign")
        ex.reduce(); ex.state_dict()     # {"layers.1.ffn.experts.w_gate_up": residual}
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], group, mode: str):
        if mode not in ("none", "sign"):
            raise ValueError(f"moelab.parallel.compression: mode {mode!r}: choose none or sign")
        self.named_params, self.group, self.mode = list(named_params), group, mode
        self.world = dist.get_world_size(group)
        self.residuals: dict[str, torch.Tensor] = {}
        self.pending: dict[str, tuple] = {}  # name -> (parameter, works, gathered bits, gathered scales)
        self.armed = False  # launch from the gradient hooks in this backward (overlap_with_backward)
        self.pop()

    def overlap_with_backward(self) -> None:
        """Launch each parameter's exchange from its post-accumulate-grad hook while the rest of backward runs,
        in backward passes where ``armed`` is set (the step's last micro batch:
        DistributedParallelized.start_micro_batch sets it); ``reduce`` then only waits and decodes."""
        for name, p in self.named_params:
            p.register_post_accumulate_grad_hook(lambda param, name=name: self._launch(name, param) if self.armed
                                                 else None)

    @torch.no_grad()
    def _launch(self, name: str, p: torch.nn.Parameter) -> None:
        W = self.world
        self.counts["expert_grad_uncompressed_bytes"][0] += 2 * (W - 1) / W * p.grad.numel() * 4  # exact ring
        if W == 1:
            return
        if self.mode == "none":
            self.pending[name] = (p, [dist.all_reduce(p.grad, group=self.group, async_op=True)], None, None)
            self.counts["expert_grad_bytes"][0] += 2 * (W - 1) / W * p.grad.numel() * p.grad.element_size()
            return
        g_XN = p.grad.reshape(p.grad.shape[0], -1)
        packed_B, scale_X, self.residuals[name] = error_feedback_step(g_XN, self.residuals.get(name))
        out_bits = packed_B.new_empty(W * packed_B.numel())  # flat: gloo's all-gather wants [W * B]
        out_scales = scale_X.new_empty(W * scale_X.numel())
        works = [dist.all_gather_into_tensor(out_bits, packed_B, group=self.group, async_op=True),
                 dist.all_gather_into_tensor(out_scales, scale_X, group=self.group, async_op=True)]
        self.counts["expert_grad_bytes"][0] += (W - 1) * (packed_B.numel() + 4 * scale_X.numel())
        self.pending[name] = (p, works, out_bits.view(W, -1), out_scales.view(W, -1))

    @torch.no_grad()
    def reduce(self) -> None:
        """After the step's backward: launch what no hook launched (in parameter order), then wait and decode."""
        for name, p in self.named_params:
            if p.grad is not None and name not in self.pending:
                self._launch(name, p)
        for p, works, bits_WB, scales_WX in self.pending.values():
            for work in works:
                work.wait()
            if bits_WB is None:
                p.grad.div_(self.world)
            else:
                p.grad.copy_(sum(decompress(bits_WB[r], scales_WX[r], p.grad.shape) for r in range(self.world))
                             / self.world)
        self.pending = {}

    def pop(self) -> dict[str, list[float]] | None:
        out = getattr(self, "counts", None)
        self.counts = {"expert_grad_bytes": [0.0], "expert_grad_uncompressed_bytes": [0.0]}
        return out

    # error feedback is per rank: moelab.train.checkpoint saves it next to the rank's RNG state
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        shapes = {n: torch.Size((p.shape[0], p[0].numel())) for n, p in self.named_params}
        for name, value in state.items():
            if shapes.get(name) != value.shape:
                raise ValueError(f"moelab.parallel.compression: residual {name} has shape {tuple(value.shape)}, "
                                 f"this rank's experts need {tuple(shapes.get(name, ()))}")
        device = self.named_params[0][1].device if self.named_params else "cpu"
        self.residuals = {k: v.to(device) for k, v in state.items()}
