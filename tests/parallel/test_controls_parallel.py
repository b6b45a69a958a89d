"""Live controls under expert parallelism: rank 0 reads the request, the step's all-reduce tells every rank a
change is due, the broadcast hands it over, and both EP ranks apply it at the same boundary, so the losses
(1e-5 relative) and the parameters match one process steered the same way; the change did act (the steered run
leaves the unsteered one). A rank that applied it a step late, or not at all, would leave the one-process
losses (bias_update_rate moves the routing that both ranks must agree on)."""
import shutil

import pytest

from moelab.contract.controls import append_request
from moelab.contract.stream import read_events

pytestmark = pytest.mark.slow

CHANGES = {"model.moe.bias_update_rate": 0.05, "model.moe.aux_loss_coeff": 0.05, "train.lr": 0.01}


def _steer(run_dir):
    run_dir.mkdir(parents=True, exist_ok=True)
    append_request(run_dir, CHANGES, who="test", at=2)
    return run_dir


def test_a_change_lands_at_the_same_step_on_every_ep_rank(helpers, reference, tmp_path):
    cfg = helpers.small_config("train.steps=5")
    ref_losses, ref_params = helpers.run_single(cfg, _steer(tmp_path / "one"))
    plain_losses, _, _ = reference("train.steps=5")
    ep2 = helpers.small_config("train.steps=5", "parallel.ep=2")
    bounds = helpers.layout_bounds(ep2)  # the layout's reordered sums (conftest.layout_bounds)
    losses, params = helpers.run_multi(ep2, _steer(tmp_path / "ep2"), 2)
    assert losses == pytest.approx(ref_losses, rel=bounds.rel, abs=0)
    helpers.assert_within(params, ref_params, bounds)
    assert ref_losses[:2] == pytest.approx(plain_losses[:2], rel=1e-6)  # the same until the change ...
    assert abs(ref_losses[3] - plain_losses[3]) > 1e-4                 # ... and not after it
    controls = [(e["step"], e["field"]) for e in read_events(tmp_path / "ep2" / "metrics.jsonl")
                if e["event"] == "control"]
    assert controls == [(2, k) for k in CHANGES]


def test_a_resume_on_more_ranks_keeps_the_changes_in_force_on_every_rank(helpers, tmp_path):
    # the changes in force at the checkpoint travel in each rank's own state; a rank new to the run has none,
    # so it takes rank 0's: the resumed EP run equals the one steered on EP ranks from the start
    ep2 = ("train.steps=5", "parallel.ep=2")
    full, _ = helpers.run_multi(helpers.small_config(*ep2), _steer(tmp_path / "ep2"), 2)
    helpers.run_single(helpers.small_config("train.steps=5", "train.checkpoint_every=3"), _steer(tmp_path / "grow"))
    # as a kill after step 5 leaves it: checkpoint 3 (the change in force since 2) is the newest
    shutil.rmtree(tmp_path / "grow" / "checkpoints" / "step_000005")
    (tmp_path / "grow" / "summary.json").unlink()
    (tmp_path / "grow" / "controls.jsonl").write_text(
        "".join(line for line in (tmp_path / "grow" / "controls.jsonl").read_text().splitlines(keepends=True)
                if '"closed"' not in line))
    losses, _ = helpers.run_multi(helpers.small_config(*ep2, "train.checkpoint_every=3"), tmp_path / "grow", 2)
    assert losses[3:] == pytest.approx(full[3:], rel=1e-5)
