"""parallel.fsdp_grad_sync=step (moelab.parallel.fsdp.set_micro_batch): a step's last micro batch reduce-scatters
the gradients and reshards the weights before the optimizer steps, so its checkpoints are those of any FSDP2 run
and a run continues from them exactly on another layout. (Its losses and parameters against one process, and its
collectives against the planner: tests/parallel/test_equivalence.py.)"""
import shutil

import pytest

from support import run_one_thread

pytestmark = pytest.mark.slow


def test_a_step_sync_checkpoint_continues_exactly_on_one_process(helpers, tmp_path):
    cfg = helpers.small_config("parallel.fsdp_grad_sync=step", "train.checkpoint_every=2", "train.keep_checkpoints=4")
    losses, params = helpers.run_multi(cfg, tmp_path / "fsdp2", 2)
    run = tmp_path / "one"
    shutil.copytree(tmp_path / "fsdp2", run)
    shutil.rmtree(run / "checkpoints/step_000004")  # as if stopped after step 2's checkpoint
    trainer = run_one_thread(cfg, run)  # parallel.fsdp=-1: one data-parallel rank here
    assert trainer.start_step == 2
    bounds = helpers.layout_bounds(cfg)  # FSDP2 against one process: reordered sums (conftest.layout_bounds)
    assert helpers.step_losses(run) == pytest.approx(losses, rel=bounds.rel, abs=0)  # steps 1-2 kept, 3-4 again
    got = {k.replace("_checkpoint_wrapped_module.", ""): v.detach().float() for k, v in trainer.model.named_parameters()}
    helpers.assert_within(got, params, bounds)
