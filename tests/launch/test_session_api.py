"""Session, Run and the executor options without a scheduler: what is checked before anything is submitted,
and the inline executor (this process)."""
from __future__ import annotations

import pytest

import moelab
from moelab import ConfigError, Run, Session
from moelab.launch.executors import get_executor, parse_time_s, resolve_executor


def test_session_sections_set_and_immutability():
    s = Session("tiny", train={"steps": 7}, parallel={"ep": 2}, model={"moe": {"top_k": 1}})
    assert (s.config.train.steps, s.config.parallel.ep, s.config.model.moe.top_k) == (7, 2, 1)
    t = s.set("model.moe.num_experts", 8)
    assert t.config.model.moe.num_experts == 8 and s.config.model.moe.num_experts != 8
    assert t.set({"train.steps": 3}).config.train.steps == 3 and t.config.train.steps == 7
    assert Session(s.config).config == s.config
    with pytest.raises(ConfigError, match="did you mean"):
        Session("tiny", train={"stepz": 3})
    with pytest.raises(ConfigError, match="num_experts"):
        s.set("model.moe.top_k", 999)


def test_plan_delegates_to_the_planner():
    p = Session("tiny").plan(gpus=1)
    assert str(p) and p.to_dict()


def test_layout_is_checked_against_the_world_before_submitting(tmp_path):
    s = Session("tiny", parallel={"ep": 2})
    with pytest.raises(ConfigError, match="parallel.ep") as e:
        s.submit("local", nproc=3, folder=tmp_path / "r")
    assert "3 rank" in str(e.value)
    with pytest.raises(ConfigError, match="inline executor runs one rank"):
        s.submit("inline", nproc=2, folder=tmp_path / "r")
    with pytest.raises(ConfigError, match="parallel.ep"):
        s.sweep({"train.lr": [1e-3, 2e-3]}, executor="local", nproc=1, folder=tmp_path / "sw")
    assert not (tmp_path / "r").exists() and not (tmp_path / "sw").exists()


def test_cluster_options_are_checked_and_listed():
    with pytest.raises(ConfigError, match="partitoin.*valid slurm options: .*partition"):
        get_executor("slurm").check_options({"partitoin": "gpu"})
    with pytest.raises(ConfigError, match="valid local options"):
        get_executor("local").check_options({"partition": "gpu"})
    with pytest.raises(ConfigError, match="nodes=2"):
        get_executor("local").check_options({"nodes": 2})
    with pytest.raises(ConfigError, match="no cluster options"):
        get_executor("inline").check_options({"time": 5})
    get_executor("slurm").check_options({"partition": "gpu", "gres": "gpu:8", "exclude": "n1",
                                         "sbatch": {"reservation": "r"}})
    with pytest.raises(ConfigError, match="executor='slurmm'"):
        resolve_executor("slurmm")
    assert resolve_executor("auto") in ("local", "slurm")
    assert get_executor("slurm").world_size(1, {"nodes": 2, "gpus_per_node": 8}) == 16
    assert get_executor("local").world_size(4, {}) == 4
    with pytest.raises(ConfigError, match="one task per GPU"):
        get_executor("slurm").world_size(4, {"gpus_per_node": 8})


def test_time_limits():
    assert parse_time_s(2) == 120 and parse_time_s(0.5) == 30
    assert parse_time_s("0:40") == 40 and parse_time_s("1:00:00") == 3600 and parse_time_s("1-0:00:00") == 86400
    for bad in ("soon", 0, -1, "0:00"):
        with pytest.raises(ConfigError, match="time="):
            parse_time_s(bad)


def test_slurm_executor_header(tmp_path):
    """The sbatch header submitit would write for moelab's options (no job is submitted)."""
    pytest.importorskip("submitit")
    import shutil

    if not shutil.which("srun"):
        pytest.skip("submitit's SlurmExecutor needs srun on PATH")
    ex = get_executor("slurm").make(tmp_path, 1, {"nodes": 2, "gpus_per_node": 4, "time": "0:40", "mem": 64,
                                                  "partition": "gpu", "setup": "module load cuda",
                                                  "sbatch": {"reservation": "r1"}})
    text = ex._make_submission_file_text("CMD", "uid")
    for line in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--time=1", "--mem=64G",
                 "--partition=gpu", "--reservation=r1", "module load cuda", "--kill-on-bad-exit=1"):
        assert line in text, line


def test_inline_run_is_a_finished_run(tmp_path, small_session, capsys):
    run = small_session(train={"steps": 3}).submit("inline", folder=tmp_path / "a")
    assert run.status == "COMPLETED" and run.executor == "inline" and run.done
    assert list(run.metrics["step"]) == [1, 2, 3] and run.routing().shape == (3, 1, 4)
    assert run.summary["status"] == "COMPLETED" and run.error is None
    shown = capsys.readouterr().err                 # the trainer's own output (its progress bar) ...
    assert "3/3" in shown and "3/3" in run.logs()   # ... stays where it ran and is in the run's log too
    again = Run.load(tmp_path / "a")
    assert again.status == "COMPLETED" and again.config == run.config and again.logs() == run.logs()
    with pytest.raises(ConfigError, match="holds this run with train.steps=3 .COMPLETED at step 3.; to extend it to 50 steps"):
        small_session().submit("inline", folder=tmp_path / "a")
    bad = small_session(train={"steps": 4, "lr": 1e30}).submit("inline", folder=tmp_path / "b")
    assert bad.status == "FAILED" and "NonFiniteLoss" in bad.error
    assert "Traceback" in bad.logs() and "NonFiniteLoss" in bad.logs()  # the log keeps the traceback
    assert [r.folder.name for r in moelab.runs(tmp_path)] == ["a", "b"]
    with pytest.raises(FileNotFoundError, match="not a moelab run folder"):
        Run.load(tmp_path)
    with pytest.raises(ConfigError, match="sweep grid"):
        small_session().sweep({"train.lr": 1e-3}, executor="inline")


def test_session_from_an_hf_folder_and_its_refusals(tmp_path):
    """Session("hf:PATH") takes the model from config.json and records the folder in train.init_from; a folder
    without config.json or weights is refused when the Session is made, a checkpoint whose tensors do not fit
    the model when it is submitted (before any rank starts, the folder left without a run)."""
    import json

    import torch
    from safetensors.torch import save_file

    from moelab.hf import config_to_hf

    ck = tmp_path / "ck"
    ck.mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        Session(f"hf:{ck}")
    model = moelab.load_config("tiny", ["model.qk_norm=true", "model.moe.num_experts=4"]).model
    (ck / "config.json").write_text(json.dumps(config_to_hf(model, "qwen3_moe")))
    with pytest.raises(ConfigError, match="has no weights"):
        Session(f"hf:{ck}")
    save_file({"model.norm.weight": torch.ones(model.hidden_size)}, str(ck / "model.safetensors"))
    s = Session(f"hf:{ck}", train={"steps": 2})
    assert s.config.train.init_from == f"hf:{ck.resolve()}" and s.config.model.moe.num_experts == 4
    with pytest.raises(ConfigError, match="train.init_from=.*model.embed_tokens.weight' is missing"):
        s.submit("inline", folder=tmp_path / "run")
    assert not (tmp_path / "run" / "run.json").exists()


@pytest.mark.parametrize("executor", ["local", pytest.param("slurm", marks=pytest.mark.slurm)])
def test_a_failing_setup_line_is_the_runs_error(tmp_path, small_session, request, executor):
    """Issue 42.13: a setup line that fails without a word (`false`, an env that is not there) ended the job
    FAILED without an error message; now the job stops at that line and the run's error names it."""
    if executor == "slurm":
        request.getfixturevalue("slurm_cluster")
    run = small_session(train={"steps": 2}).submit(executor, folder=tmp_path / "a", time=5,
                                                   setup=["true", "test -d /no/such/env"])
    assert run.wait(240).status == "FAILED"
    assert "the setup line `test -d /no/such/env` failed with exit code 1" in (run.error or ""), run.error
    assert not run.events, "no rank started"
