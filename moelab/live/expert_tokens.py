"""Readers of expert_tokens.jsonl (moelab.contract.expert_tokens): a table of each expert's most frequent
tokens, decoded with the run's tokenizer, and a figure of it. Run.expert_tokens and Run.plot_expert_tokens
open them.

    table = expert_token_table("runs/tiny", layer=0)      # one row per (expert, rank): token, count, share
    fig = plot_expert_tokens("runs/tiny", layer=0)        # a matplotlib Figure
"""
from __future__ import annotations

from pathlib import Path

from moelab.contract.expert_tokens import read_expert_tokens
from moelab.contract.folder import RunFolder


def run_tokenizer(run_dir: "str | Path"):
    """The tokenizer a run trained with (decoding its token ids), or None for synthetic data and token files."""
    from moelab.config import ConfigError, load_config

    try:
        cfg = load_config(RunFolder(run_dir).config)
    except Exception:  # an unreadable config: ids stay undecoded
        return None
    if cfg.data.kind not in ("text", "hf"):
        return None
    from moelab.data.tokenizer import ByteTokenizer, HFTokenizer

    if cfg.data.tokenizer == "bytes":
        return ByteTokenizer()
    saved = RunFolder(run_dir).tokenizer
    try:
        return HFTokenizer(saved, saved.name) if saved.is_file() else None
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
        raise FileNotFoundError(f"{RunFolder(run_dir).expert_tokens}: no expert-token records; run with "
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
