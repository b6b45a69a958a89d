"""Expert specialisation: which token ids each expert receives (train.expert_tokens_every).

Every N steps, after the step (off the hot path: the training step itself is unchanged), the trainer runs one
gradient-free forward of that step's global batch with a hook on every router, counts per MoE layer and
expert how often each token id was sent there (kept assignments: what the expert computed on), sums the counts
over ranks, and rank 0 appends one line to ``RUN/expert_tokens.jsonl`` (its format and reader:
moelab.contract.expert_tokens; the table and figure of it: moelab.live.expert_tokens).

Shape legend: B batch, L sequence, T tokens, K top-k, E experts, V vocabulary.

    ExpertTokenRecorder(trainer).record(step)     # the step's record; rank 0 appends it
"""
from __future__ import annotations

import torch

from moelab.contract.expert_tokens import TOP, append_expert_tokens
from moelab.data.batches import micro_batch
from moelab.data.transfer import to_device
from moelab.train.evaluate import inspect_forward, inspecting, rank_micro_batches


class ExpertTokenRecorder:
    """Counts the token ids each expert receives in one probe forward (see the module docstring).

        ExpertTokenRecorder(trainer).record(step)     # appends a line to RUN/expert_tokens.jsonl on rank 0
    """

    def __init__(self, trainer):
        self.trainer = trainer

    def record(self, step: int) -> dict | None:
        tr = self.trainer
        t, par, dev, V = tr.cfg.train, tr.par, tr.env.device, tr.cfg.model.vocab_size
        E = tr.cfg.model.moe.num_experts
        moes = par.moe_layers_all
        counts_MEV = torch.zeros(len(moes), E, V, device=dev)
        ids = {}
        hooks = []
        for l, moe in enumerate(moes):
            if moe is None:
                continue

            def hook(module, args, out, l=l):
                experts_TK, keep_TK = out[1], out[2]
                ids_T = ids["T"]
                flat_TK = experts_TK * V + ids_T[:, None]
                if keep_TK is not None:
                    flat_TK = flat_TK[keep_TK]
                counts_MEV[l].view(-1).add_(torch.bincount(flat_TK.reshape(-1), minlength=E * V).float())

            hooks.append(moe.router.register_forward_hook(hook))
        try:
            with inspecting(tr):
                for first in rank_micro_batches(tr):
                    inputs_BL = to_device(micro_batch(tr.dataset, step, first, t.micro_batch_size)[:, :-1], dev)
                    ids["T"] = par.shard_sequence(inputs_BL).reshape(-1)  # the tokens the routers see, in order
                    inspect_forward(tr, inputs_BL)
        finally:
            for h in hooks:
                h.remove()
        layers = []
        for l in range(len(moes)):  # one layer at a time: E * V counts can be large
            c_EV = par.all_reduce_sum(counts_MEV[l].contiguous()).cpu()
            layers.append(_top(c_EV))
        record = {"step": step, "layers": layers}
        if tr.writer is not None:
            append_expert_tokens(tr.run_dir, record)
        return record


def _top(c_EV: torch.Tensor) -> list[dict]:
    k = min(TOP, c_EV.shape[1])
    totals_E = c_EV.sum(1)
    values_EV, ids_EV = c_EV.sort(dim=1, descending=True, stable=True)  # ties: the lower id first
    values_EK, ids_EK = values_EV[:, :k], ids_EV[:, :k]
    out = []
    for e in range(c_EV.shape[0]):
        total = float(totals_E[e])
        top = [[int(i), int(v), float(v) / total] for i, v in zip(ids_EK[e].tolist(), values_EK[e].tolist())
               if v > 0]
        out.append({"expert": e, "tokens": int(total), "top": top})
    return out
