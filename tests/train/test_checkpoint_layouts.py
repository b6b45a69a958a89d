"""A checkpoint is loadable into another layout: one process -> two processes with expert parallelism (EP=2,
each rank holding half the experts) or tensor parallelism (TP=2, each rank holding half of every attention and
dense projection, of the embedding and of the head) -> one process again, through moelab's own launcher (gloo on
CPU)."""
from __future__ import annotations

import shutil

import pytest
import torch

from moelab.config import load_config, save_config
from moelab.parallel.env import DistEnv
from moelab.launch.resume import resume
from moelab.contract.checkpoints import list_checkpoints, read_metadata
from moelab.contract.stream import read_events
from moelab.train.trainer import Trainer

pytestmark = pytest.mark.slow
STEPS = 4
OVERRIDES = {"train.steps": STEPS, "model.num_layers": 2, "train.seq_len": 32, "train.global_batch_size": 4,
             "train.micro_batch_size": 2, "train.device": "cpu", "train.warmup_steps": 1,
             "model.moe.bias_update_rate": 0.01, "train.checkpoint_every": 2, "train.keep_checkpoints": 4}


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.named_parameters()}


# the moved run against the one-process run: EP computes the same sums (tight); TP adds its partial sums in
# another order, which Adam lifts to up to lr/3 in near-zero-gradient elements (tests/parallel/test_tensor_parallel)
MOVES = {"ep": (1e-4, 1e-5), "tp": (1e-3, 1e-3)}  # layout field set to 2: (relative, absolute) parameter bound


@pytest.mark.parametrize("field", MOVES)
def test_one_process_to_two_and_back(field, tmp_path):
    cfg = load_config("tiny", OVERRIDES)
    base = tmp_path / "one"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like each launched rank
    try:
        ref = Trainer(cfg, base, env=DistEnv())
        ref.run()
    finally:
        torch.set_num_threads(threads)
    ref_losses = {e["step"]: e["loss"] for e in read_events(base / "metrics.jsonl") if e["event"] == "step"}

    # continue the one-process run from step 2 on two processes with EP=2 (parallel.* may change on resume)
    run = tmp_path / "ep2"
    shutil.copytree(base, run)
    shutil.rmtree(run / "checkpoints/step_000004")
    # as a run killed after step 4 (no end event, no summary): a completed run is not resumed (the re-run rule)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(x for x in lines if '"event": "end"' not in x))
    (run / "summary.json").unlink(missing_ok=True)
    save_config(cfg.replace(**{f"parallel.{field}": 2}), run / "config.yaml")
    summary = resume(run, nproc=2).wait().summary()
    assert summary["status"] == "COMPLETED"
    events = read_events(run / "metrics.jsonl")
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4]
    start = [e for e in events if e["event"] == "start"][-1]
    assert start["start_step"] == 2 and start["env"]["world_size"] == 2 and start["env"]["layout"][field] == 2
    assert any(e["event"] == "warning" and e["kind"] == "layout_changed" for e in events)
    for e in events:
        if e["event"] == "step" and e["step"] > 2:
            assert e["loss"] == pytest.approx(ref_losses[e["step"]], rel=1e-4, abs=1e-5)
    meta = read_metadata(run / "checkpoints/step_000004")
    assert meta["world_size"] == 2 and meta["layout"][field] == 2

    # and load the two-process checkpoint (each rank wrote its own experts, or its TP shards) into one process
    back = Trainer(cfg, run, env=DistEnv())
    back.setup()
    assert back.start_step == STEPS
    got, want = _params(back.model), _params(ref.model)
    assert got.keys() == want.keys()
    for name in want:
        rtol, atol = MOVES[field]
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    experts = [n for n in want if ".experts." in n]
    assert experts and all(got[n].shape[0] == cfg.model.moe.num_experts for n in experts)
    print(f"\nRELIABILITY checkpoint moved 1 process -> {field.upper()}=2 on 2 processes -> 1 process; "
          f"{len(want)} tensors ({len(experts)} expert stacks) match, {len(list_checkpoints(run))} checkpoints")


def test_sigterm_to_one_rank_stops_both_at_the_same_step_and_resume_continues(tmp_path):
    import os
    import signal
    import threading
    import time

    from moelab.launch.local import run_local_processes
    from moelab.contract.stream import JsonlTail

    cfg = load_config("tiny", {**OVERRIDES, "train.steps": 8, "train.checkpoint_every": 0})
    run = tmp_path / "run"

    def kill_rank0_at_step_2():
        tail, end = JsonlTail(run / "metrics.jsonl"), time.monotonic() + 300
        pid = None
        while time.monotonic() < end:
            for e in tail.poll():
                pid = e["env"]["pid"] if e["event"] == "start" else pid
                if e["event"] == "step" and e["step"] >= 2 and pid:
                    os.kill(pid, signal.SIGTERM)  # rank 0 only: the step's all-reduce tells rank 1
                    return
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_rank0_at_step_2, daemon=True)
    watcher.start()
    summary = run_local_processes(cfg, run, 2)
    watcher.join()
    assert summary["status"] == "PREEMPTED"
    stopped = summary["steps"]
    assert 2 <= stopped < 8
    meta = read_metadata(run / f"checkpoints/step_{stopped:06d}")
    assert meta["world_size"] == 2, "both ranks wrote the checkpoint at the same step"
    assert resume(run).wait().summary()["status"] == "COMPLETED"  # on 2 processes again: the run's former world size
    events = read_events(run / "metrics.jsonl")
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, 9))
    assert [e["env"]["world_size"] for e in events if e["event"] == "start"] == [2, 2]
    print(f"\nRELIABILITY SIGTERM to rank 0 of 2: both ranks stopped at step {stopped}, resumed to 8")
