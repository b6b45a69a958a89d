"""Every file name the code writes into a run folder is declared in moelab/contract/folder.py: a real run (text
data with a trained BPE tokenizer, evaluation, expert-token records, checkpoints), a live change, a fork of it,
and `moelab bench`'s rank entry in its bench mode write their folders; every path in them is a declared name, or
one of the generated names the contract defines (a checkpoint's step folder and per-rank files, a rank's log),
or inside a folder the contract hands to another tool (torch.distributed.checkpoint's files, TensorBoard,
submitit)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from moelab import Session
from moelab.contract import folder as contract
from moelab.contract.checkpoints import rank_state_file, rng_file, step_dir_name
from moelab.run.run import Run

SMALL = {"model": {"num_layers": 2, "hidden_size": 32, "vocab_size": 300,
                   "moe": {"num_experts": 4, "expert_ffn_size": 32}},
         "train": {"seq_len": 16, "global_batch_size": 4, "micro_batch_size": 2, "device": "cpu",
                   "warmup_steps": 1, "steps": 4, "checkpoint_every": 2, "keep_checkpoints": 5, "eval_every": 2,
                   "eval_batches": 1, "expert_tokens_every": 2}}
# files torch.distributed.checkpoint writes inside a checkpoint folder (its own format, not moelab's names)
DCP_FILE = re.compile(r"\.metadata|__\d+_\d+\.distcp")
# folders whose contents belong to another tool
FOREIGN = {contract.TENSORBOARD, contract.SUBMITIT}


def declared() -> set[str]:
    """Every file or folder name contract/folder.py declares (its upper-case string constants)."""
    return {v for k, v in vars(contract).items() if k.isupper() and isinstance(v, str)}


def undeclared(run: Path) -> list[str]:
    """The paths under `run` that the contract does not name (see the module docstring)."""
    names, bad = declared(), []
    steps = re.compile(r"step_\d{6}")
    per_rank = {rng_file(0).split("/")[0]: re.compile(re.escape(rng_file(0)).replace("00000", r"\d{5}")),
                rank_state_file(0).split("/")[0]:
                    re.compile(re.escape(rank_state_file(0)).replace("00000", r"\d{5}"))}
    for path in sorted(run.rglob("*")):
        parts = path.relative_to(run).parts
        if parts[0] not in names:
            bad.append("/".join(parts))
        elif parts[0] in FOREIGN or len(parts) == 1:
            continue
        elif parts[0] == contract.LOGS:
            if not re.fullmatch(r"rank\d+\.(out|err)", parts[1]):
                bad.append("/".join(parts))
        elif parts[0] == contract.CHECKPOINTS:
            if not steps.fullmatch(parts[1]) or step_dir_name(int(parts[1][5:])) != parts[1]:
                bad.append("/".join(parts))
            elif len(parts) == 3 and path.is_file():
                if parts[2] != contract.CHECKPOINT_METADATA and not DCP_FILE.fullmatch(parts[2]):
                    bad.append("/".join(parts))
            elif len(parts) >= 3 and not (parts[2] in per_rank and (
                    len(parts) == 3 or per_rank[parts[2]].fullmatch("/".join(parts[2:])))):
                bad.append("/".join(parts))
        else:
            bad.append("/".join(parts))
    return bad


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("names")
    data = {"kind": "text", "path": "stdlib", "val_fraction": 0.05, "tokenizer": "bpe",
            "cache_dir": str(root / "cache")}
    parent = Session("tiny", model=SMALL["model"], train=SMALL["train"], data=data).submit(
        "inline", folder=root / "run")
    fork = Run.load(parent.folder).fork(step=2, name="fork", executor="inline", aux_loss_coeff=0.01)
    from moelab.launch.entry import bench_rank
    from moelab.config import save_config

    bench = root / "bench"
    bench.mkdir()
    save_config(parent.config, bench / contract.CONFIG)
    bench_rank(bench, steps=1, warmup=1, command="test")
    return [Path(parent.folder), Path(fork.folder), bench]


def test_every_file_a_run_a_fork_and_a_bench_write_is_declared_in_contract_folder(runs):
    parent, fork, bench = runs
    written = {p.name for r in runs for p in r.iterdir()}
    for name in (contract.CONFIG, contract.METRICS, contract.SUMMARY, contract.INFO, contract.CHECKPOINTS,
                 contract.TOKENIZER, contract.EXPERT_TOKENS, contract.FORK, contract.CONTROLS, contract.BENCH):
        assert name in written, f"{name}: no run wrote it (the test no longer covers it)"
    bad = [f"{r.name}/{p}" for r in runs for p in undeclared(r)]
    assert not bad, "files written but not declared in moelab/contract/folder.py:\n" + "\n".join(bad)


def test_the_checker_finds_an_undeclared_name(tmp_path):
    for rel in ("metrics.jsonl", "checkpoints/step_000002/metadata.json", "checkpoints/step_000002/rng/rank_00000.json",
                "checkpoints/step_000002/__0_0.distcp", "logs/rank0.err", "tensorboard/events.out.x"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert undeclared(tmp_path) == []
    for rel in ("notes.json", "checkpoints/step_2/metadata.json", "checkpoints/step_000002/extra.json",
                "checkpoints/step_000002/rng/rank_0.json", "logs/rank0.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert undeclared(tmp_path) == ["checkpoints/step_000002/extra.json", "checkpoints/step_000002/rng/rank_0.json",
                                    "checkpoints/step_2", "checkpoints/step_2/metadata.json", "logs/rank0.txt",
                                    "notes.json"]
