"""expert_tokens.jsonl: which token ids each expert received (train.expert_tokens_every), and its reader.

Every N steps rank 0 appends one line (moelab.train.expert_tokens.ExpertTokenRecorder writes it):

    {"step": 100, "layers": [[{"expert": 0, "tokens": 812, "top": [[id, count, share], ...]}, ...], ...]}

``layers[l][e]`` is MoE layer l (index among MoE layers, as in the metrics stream), expert e; ``tokens`` the
expert's kept assignments; ``top`` its most frequent token ids (at most TOP), ``share`` = count / tokens.

    append_expert_tokens("runs/tiny", {"step": 100, "layers": [...]})
    read_expert_tokens("runs/tiny")[-1]["step"]       # 100
"""
from __future__ import annotations

import json
from pathlib import Path

from moelab.contract.folder import RunFolder
from moelab.contract.writes import append_line

TOP = 20  # token ids kept per expert


def append_expert_tokens(run_dir: "str | Path", record: dict) -> None:
    """Append one step's record as one line (one O_APPEND write: moelab.contract.writes.append_line)."""
    append_line(RunFolder(run_dir).expert_tokens, (json.dumps(record) + "\n").encode())


def read_expert_tokens(run_dir: "str | Path") -> list[dict]:
    """Every record of RUN/expert_tokens.jsonl, in step order (the last record of a step wins: a resumed run
    records a step again)."""
    path = RunFolder(run_dir).expert_tokens
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
