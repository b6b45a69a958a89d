"""What PipelineRunner hands torch's pipeline schedule. torch 2.11 (the GPU machine's) asserts that stages other
than the first get no inputs, and compares each micro batch's strides with those seen at shape inference; the
CPU wheel here (2.13) checks neither, so the equivalence tests cannot catch a regression. This test records the
arguments of `schedule.step` instead (and that the BatchContext goes to every stage as a keyword) (both failures were found on two H200s: gallery/perf-notes.md)."""
import pytest
import torch

from moelab.model.batch_context import BatchContext
from moelab.parallel.pipeline import PipelineRunner


class RecordingSchedule:
    """Stands in for torch's schedule object: records step()'s arguments and returns one loss per micro batch."""

    def __init__(self, n_micro):
        self.n_micro, self.calls = n_micro, []

    def step(self, *args, target=None, losses=None, return_outputs=True, **kwargs):
        self.calls.append((args, target, return_outputs, kwargs))
        if losses is not None:
            losses.extend(torch.tensor(float(i + 1)) for i in range(self.n_micro))


def runner(holds_first: bool, holds_last: bool, n_micro: int = 2) -> PipelineRunner:
    r = PipelineRunner.__new__(PipelineRunner)  # the schedule itself needs a process group; its inputs do not
    r.holds_first, r.holds_last, r.n_microbatches = holds_first, holds_last, n_micro
    r.schedule = RecordingSchedule(n_micro)
    return r


@pytest.mark.parametrize("holds_first,holds_last", [(True, False), (False, True), (True, True), (False, False)])
def test_only_the_first_stage_gets_inputs_and_only_the_last_targets(holds_first, holds_last):
    batch = torch.arange(2 * 9).reshape(2, 9)
    inputs, targets = batch[:, :-1], batch[:, 1:]  # the trainer's shifted views: not contiguous
    r = runner(holds_first, holds_last)
    ctx = BatchContext(loss_scale=0.5)
    loss = r.forward_backward(inputs, targets, ctx)
    (args, target, return_outputs, kwargs), = r.schedule.calls
    # every stage gets the batch's context (its loss scale) and the targets as a keyword (only the last stage's
    # model uses them); the merge of the last stage's outputs (scalar losses) is skipped
    assert kwargs.keys() == {"targets_BL", "ctx"} and kwargs["ctx"] is ctx and kwargs["targets_BL"] is target
    assert return_outputs is False
    if holds_first:
        assert len(args) == 1 and args[0].is_contiguous() and torch.equal(args[0], inputs)
    else:
        assert args == ()
    if holds_last:
        assert target.is_contiguous() and torch.equal(target, targets)
        assert loss.item() == pytest.approx((1 + 2) * 2)  # summed micro-batch losses, times their count
    else:
        assert target is None and loss.item() == 0
