"""Expert specialisation: which token ids each expert receives (train.expert_tokens_every).

Every N steps, after the step (off the hot path: the training step itself is unchanged), the trainer runs one
gradient-free forward of that step's global batch with a hook on every router, counts per MoE layer and
expert how often each token id was sent there (kept assignments: what the expert computed on), sums the counts
over ranks, and rank 0 appends one line to ``RUN/expert_tokens.jsonl``:

    {"step": 100, "layers": [[{"expert": 0, "tokens": 812, "top": [[id, count, share], ...]}, ...], ...]}

``layers[l][e]`` is MoE layer l (index among MoE layers, as in the metrics stream), expert e; ``share`` =
count / the expert's tokens. Readers: ``expert_token_table`` (a table with decoded tokens where the run has a
tokenizer: the text tokenizers save theirs in the run folder) and ``plot_expert_tokens``.

Shape legend: B batch, L sequence, T tokens, K top-k, E experts, V vocabulary.

    table = expert_token_table("runs/tiny", layer=0)      # one row per (expert, rank): token, count, share
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from moelab.contract.writes import append_line
from moelab.data.batches import micro_batch
from moelab.train.evaluate import inspect_forward, inspecting, rank_micro_batches

FILE = "expert_tokens.jsonl"
TOP = 20  # token ids kept per expert


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
                    inputs_BL = micro_batch(tr.dataset, step, first, t.micro_batch_size)[:, :-1].to(dev)
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
            append_line(tr.run_dir / FILE, (json.dumps(record) + "\n").encode())
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


def read_expert_tokens(run_dir: "str | Path") -> list[dict]:
    """Every record of RUN/expert_tokens.jsonl, in step order (the last record of a step wins: a resumed run
    records a step again)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return []
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                r = json.loads(line)
            except ValueError:  # a half-written last line of a live run
                continue
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def run_tokenizer(run_dir: "str | Path"):
    """The tokenizer a run trained with (decoding its token ids), or None for synthetic data and token files."""
    from moelab.config import ConfigError, load_config

    run_dir = Path(run_dir)
    try:
        cfg = load_config(run_dir / "config.yaml")
    except Exception:  # an unreadable config: ids stay undecoded
        return None
    if cfg.data.kind not in ("text", "hf"):
        return None
    from moelab.data.tokenizer import ByteTokenizer, HFTokenizer

    if cfg.data.tokenizer == "bytes":
        return ByteTokenizer()
    saved = run_dir / "tokenizer.json"
    try:
        return HFTokenizer(saved, "tokenizer.json") if saved.is_file() else None
    except ConfigError:  # e.g. its end-of-document token was named in a tokenizer_config.json left behind
        return None


def token_text(tokenizer, token_id: int) -> str:
    """A token shown readably: its decoded text in repr quotes, or "#id" without a tokenizer."""
    if tokenizer is None:
        return f"#{token_id}"
    if getattr(tokenizer, "name", None) == "bytes":
        b = bytes([token_id])
        return repr(b.decode("ascii")) if token_id < 128 else f"0x{token_id:02x}"
    return repr(tokenizer.decode([token_id]))


def expert_token_table(run_dir: "str | Path", layer: int = 0, step: int | None = None, top: int = 5):
    """One row per expert and rank (1 = the expert's most frequent token): step, layer, expert, rank,
    token_id, token (decoded where the run has a tokenizer), count, share (of the expert's tokens),
    expert_tokens. `step` None = the latest record. A pandas DataFrame where pandas is installed."""
    records = read_expert_tokens(run_dir)
    if not records:
        raise FileNotFoundError(f"{Path(run_dir) / FILE}: no expert-token records; run with "
                                f"train.expert_tokens_every=N")
    steps = [r["step"] for r in records]
    rec = records[-1] if step is None else next((r for r in records if r["step"] == step), None)
    if rec is None:
        raise ValueError(f"expert_tokens: no record at step {step}; recorded steps: {steps}")
    if not 0 <= layer < len(rec["layers"]):
        raise ValueError(f"expert_tokens: layer {layer} out of range; the run has {len(rec['layers'])} MoE layers")
    tok = run_tokenizer(run_dir)
    rows = [{"step": rec["step"], "layer": layer, "expert": e["expert"], "rank": r + 1, "token_id": tid,
             "token": token_text(tok, tid), "count": count, "share": share, "expert_tokens": e["tokens"]}
            for e in rec["layers"][layer] for r, (tid, count, share) in enumerate(e["top"][:top])]
    try:
        import pandas as pd
    except ImportError:
        return rows
    return pd.DataFrame(rows)


def plot_expert_tokens(run_dir: "str | Path", layer: int = 0, step: int | None = None, top: int = 5):
    """A figure of one MoE layer: per expert a horizontal bar of its `top` tokens' shares, labelled."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    table = expert_token_table(run_dir, layer, step, top)
    rows = table.to_dict("records") if hasattr(table, "to_dict") else table
    experts = sorted({r["expert"] for r in rows})
    fig = Figure(figsize=(7.0, 0.35 * len(experts) + 1.2), dpi=80, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in rows:
        left = sum(x["share"] for x in rows if x["expert"] == r["expert"] and x["rank"] < r["rank"])
        ax.barh(r["expert"], r["share"], left=left, color=f"C{(r['rank'] - 1) % 10}", edgecolor="white")
        if r["share"] > 0.04:
            ax.text(left + r["share"] / 2, r["expert"], r["token"], ha="center", va="center", fontsize=6)
    ax.set_yticks(experts)
    ax.invert_yaxis()
    ax.set_title(f"MoE layer {layer}: each expert's most frequent tokens (step {rows[0]['step'] if rows else '-'})",
                 fontsize=9, loc="left")
    ax.set_xlabel("share of the expert's tokens", fontsize=8)
    ax.set_ylabel("expert", fontsize=8)
    ax.tick_params(labelsize=7)
    return fig
