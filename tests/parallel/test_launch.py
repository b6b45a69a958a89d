"""`moelab run --nproc`: the CLI's multi-process path matches the single-process one, and impossible layouts fail
before any process starts, naming the field and the fix. Also the rank layout of the meshes."""
import pytest
import torch

from moelab.cli import main
from moelab.config import ConfigError, load_config
from moelab.launch.local import run_local_processes
from moelab.layout.dims import check_layout, coords_of


@pytest.mark.slow
def test_cli_nproc_2_with_ep_2_matches_one_process(helpers, tmp_path):
    args = ["run", "tiny", "--steps", "6", "--set", "train.seq_len=32"]
    assert main(args + ["--out", str(tmp_path / "one")]) == 0
    assert main(args + ["--out", str(tmp_path / "two"), "--nproc", "2", "--set", "parallel.ep=2"]) == 0
    one, two = helpers.step_losses(tmp_path / "one"), helpers.step_losses(tmp_path / "two")
    from moelab.config import load_config

    bounds = helpers.layout_bounds(load_config(tmp_path / "two" / "config.yaml"))  # (conftest.layout_bounds)
    assert len(one) == 6 and two == pytest.approx(one, rel=bounds.rel, abs=0)
    assert sorted((tmp_path / "two" / "logs").iterdir()) == [tmp_path / "two" / "logs" / f"rank{r}.{s}"
                                                             for r in range(2) for s in ("err", "out")]
    ev = helpers.step_events(tmp_path / "two")[-1]
    assert len(ev["memory"]["per_rank"]) == 2 and ev["tokens_per_s_per_gpu"] == pytest.approx(ev["tokens_per_s"] / 2)


@pytest.mark.parametrize("overrides, nproc, match", [
    (["parallel.ep=3"], 3, "parallel.ep=3: must divide model.moe.num_experts=16"),
    (["parallel.fsdp=4"], 2, "parallel.fsdp=4: tp\\*pp\\*cp\\*fsdp = 4 but the world size is 2"),
    (["parallel.ep=4"], 2, "parallel.ep=4: must divide fsdp\\*cp\\*tp=2"),
    (["parallel.pp=3"], 2, "tp\\*pp\\*cp=3 must divide the world size 2"),
    (["train.global_batch_size=4", "train.micro_batch_size=4"], 2, "must be a multiple of micro_batch_size\\*dp"),
    (["parallel.tp=8"], 8, "parallel.tp=8: must divide model.num_heads"),
    (["parallel.cp=2", "parallel.pp=2"], 4, "does not compose with pipeline stages yet"),
    (["parallel.cp=2", "train.seq_len=34"], 2, "train.seq_len=34: must be a multiple of 2\\*cp=4"),
    (["parallel.pp=2", "train.micro_batch_size=8"], 2, "1 micro batches per data-parallel rank; the pipeline"),
    (["parallel.pp=2", "parallel.vp=2", "parallel.pp_schedule=interleaved_1f1b", "train.global_batch_size=12",
      "train.micro_batch_size=4"], 2, "and a multiple of it"),
    (["parallel.pp=2", "model.tie_embeddings=true"], 2, "different pipeline stages"),
    (["parallel.pp=2", "parallel.vp=2", "parallel.pp_schedule=gpipe", "train.micro_batch_size=2"], 2,
     "with parallel.vp=2 virtual stages use interleaved_1f1b"),
])
def test_impossible_layouts_fail_before_any_process_starts(overrides, nproc, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        run_local_processes(load_config("tiny", overrides), tmp_path / "run", nproc)
    assert not (tmp_path / "run" / "logs").exists()


def test_rank_layout_puts_ep_peers_next_to_each_other():
    cfg = load_config("tiny", ["parallel.ep=2", "parallel.cp=2", "train.micro_batch_size=2"])
    layout = check_layout(cfg, 8)  # fsdp = 4, cp = 2
    coords = [coords_of(layout, r) for r in range(8)]
    assert [(c.dp, c.cp) for c in coords] == [(d, c) for d in range(4) for c in range(2)]
    assert [c.ep for c in coords] == [0, 1] * 4 and [c.efsdp for c in coords] == [0, 0, 1, 1, 2, 2, 3, 3]
    pp = check_layout(load_config("tiny", ["parallel.pp=2", "parallel.ep=2", "train.micro_batch_size=2"]), 4)
    assert [(coords_of(pp, r).pp, coords_of(pp, r).ep) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_context_parallel_shards_balance_causal_work():
    from moelab.parallel.context import balanced_shard

    seq = torch.arange(16)[None]
    shards = [balanced_shard(seq, 4, r)[0].tolist() for r in range(4)]
    assert shards == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert len({sum(s) for s in shards}) == 1  # every rank's queries see the same number of keys in total
