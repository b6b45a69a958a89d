"""The single-process trainer: it learns, it is deterministic, and it stops on a non-finite loss."""
import pytest

from moelab.config import load_config
from moelab.contract.stream import read_events
from moelab.train.trainer import NonFiniteLoss, Trainer


def _losses(path):
    return [e["loss"] for e in read_events(path / "metrics.jsonl") if e["event"] == "step"]


def test_tiny_model_learns_the_synthetic_task(tmp_path):
    summary = Trainer(load_config("tiny", ["train.steps=60"]), tmp_path).run()
    # the chain's entropy is far below ln(256) = 5.55; the loss must fall far below its start
    assert summary["first_loss"] > 5.0 and summary["final_loss"] < 0.5 * summary["first_loss"]


def test_same_seed_same_losses_other_seed_other_losses(tmp_path):
    cfg = load_config("tiny", ["train.steps=4"])
    Trainer(cfg, tmp_path / "a").run()
    Trainer(cfg, tmp_path / "b").run()
    Trainer(cfg.replace(**{"train.seed": 1}), tmp_path / "c").run()
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    assert _losses(tmp_path / "a") != _losses(tmp_path / "c")


def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path):
    # global batch 8 as 2 micro batches of 4, or as 1 micro batch of 8: the same optimisation
    base = ["train.steps=3", "model.moe.aux_loss_coeff=0.0"]
    Trainer(load_config("tiny", base + ["train.micro_batch_size=4"]), tmp_path / "acc").run()
    Trainer(load_config("tiny", base + ["train.micro_batch_size=8"]), tmp_path / "one").run()
    assert _losses(tmp_path / "acc") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)


def test_a_non_finite_loss_stops_the_run_naming_the_step(tmp_path):
    cfg = load_config("tiny", ["train.steps=5", "train.lr=1e30", "train.warmup_steps=0", "train.grad_clip=0"])
    with pytest.raises(NonFiniteLoss, match="non-finite loss at step 2"):
        Trainer(cfg, tmp_path).run()
    events = read_events(tmp_path / "metrics.jsonl")
    assert events[-1]["event"] == "error" and "step 2" in events[-1]["message"]


def test_grouped_and_loop_experts_train_identically(tmp_path):
    Trainer(load_config("tiny", ["train.steps=3", "backend.experts=grouped_mm"]), tmp_path / "g").run()
    Trainer(load_config("tiny", ["train.steps=3", "backend.experts=loop"]), tmp_path / "l").run()
    assert _losses(tmp_path / "g") == pytest.approx(_losses(tmp_path / "l"), rel=1e-5)


def test_a_distenv_on_another_device_than_train_device_is_refused(tmp_path):
    """train.device=cuda with an explicitly passed CPU DistEnv would silently train on the CPU (as a GPU script
    once did): refused, naming the field and the fix."""
    from moelab.config import ConfigError, load_config
    from moelab.parallel.env import DistEnv
    from moelab.train.trainer import Trainer

    with pytest.raises(ConfigError, match=r"train.device='cuda'.*DistEnv runs on 'cpu'"):
        Trainer(load_config("tiny", ["train.device=cuda"]), tmp_path, env=DistEnv())
    Trainer(load_config("tiny", ["train.device=cpu"]), tmp_path, env=DistEnv())  # the same device: accepted
