"""A per-rank entry point for the tests: moelab.launch.entry's job, plus what only tests need.

    python -m rank_entry RUN_DIR      (with tests/parallel on PYTHONPATH; launched by run_local_processes)

It ends as a moelab rank ends (moelab.launch.entry.end_process), never through the interpreter's teardown: there a
gloo worker that frees a finished collective's tensors late (a busy machine) aborted the rank after a complete run.

After training, every parameter is gathered to a full tensor (all shards, all experts) and rank 0 saves them to
RUN_DIR/params.pt, so a test can compare them with a single-process run; every rank writes
RUN_DIR/placement_rank<r>.json (``placement``: which parameters are DTensors, the FSDP2 units with their
reshard and prefetch settings, the optimizer groups' parameter kinds, the LM head's loss (loss_kind), how many
parameters were allocated whole or as FSDP2 shards, and FSDP2's collectives in each training step:
``count_collectives``).

TEST_TRITON_MIN_NUMEL=N lowers TritonAdamW.MIN_NUMEL (train.optimizer=adamw_triton under TRITON_INTERPRET=1), so
the tiny model's tensors go through the Triton kernel rather than torch's step.

Fault injection (tests only, never in moelab): TEST_FAULT="RANK:STEP:exit" makes that rank os._exit(13) when it
starts STEP; "RANK:STEP:hang" makes it sleep instead, like a stuck GPU. TEST_RANK_OVERRIDES="RANK:key=value,..."
trains that rank with other config values (a bug confined to one rank: a dropped loss term).
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

from moelab.config import load_config
from moelab.launch.entry import end_process, exit_code
from moelab.parallel.distributed import full_state_dict
from moelab.train.trainer import Trainer


def placement(model, optimizer) -> dict:
    """What FSDP2 wrapped and how, read back from the model (FSDP2's own state) and the optimizer."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    clean = lambda n: n or "<root>"  # noqa: E731
    names = {id(m): clean(n) for n, m in model.named_modules()}
    units = {}
    for n, m in model.named_modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            group = state._fsdp_param_group
            units[clean(n)] = {
                "mesh_size": group.mesh_info.mesh.size() if group is not None else None,
                "reshard_after_forward": bool(group is not None and group.post_forward_mesh_info is not None),
                "forward_prefetch": [names[id(s._modules[0])] for s in state._states_to_forward_prefetch],
                "backward_prefetch": [names[id(s._modules[0])] for s in state._states_to_backward_prefetch]}
    kind = lambda p: "dtensor" if isinstance(p, DTensor) else "plain"  # noqa: E731
    return {"params": {clean(n): kind(p) for n, p in model.named_parameters()}, "units": units,
            "optimizer": type(optimizer).__name__,
            "groups": [{"name": g["name"], "kinds": sorted({kind(p) for p in g["params"]}),
                        "meshes": sorted({str(p.device_mesh.mesh.tolist()) for p in g["params"]
                                          if isinstance(p, DTensor)})} for g in optimizer.param_groups]}


ALLOCATED = {"plain": 0, "dtensor": 0}  # parameter kinds when placement allocated them (moelab.parallel.place)


def record_allocation() -> None:
    """Count, at each materialize call of moelab.parallel.distributed, how many parameters are still plain
    tensors (allocated whole) and how many FSDP2 shards (allocated as their rows only)."""
    import moelab.parallel.distributed as distributed
    from torch.distributed.tensor import DTensor

    inner = distributed.materialize

    def spy(model, cfg, device):
        for p in model.parameters():
            ALLOCATED["dtensor" if isinstance(p, DTensor) else "plain"] += 1
        return inner(model, cfg, device)

    distributed.materialize = spy


COLLECTIVES: list[dict] = []  # per training step: FSDP2's all-gathers and reduce-scatters on this rank


def count_dtensor_collectives(now: dict) -> None:
    """Count DTensor's sequence-parallel all-gathers and reduce-scatters (tensor parallelism: its functional
    collectives, which FSDP2 does not use) into now["tp_all_gathers"] / now["tp_reduce_scatters"]."""
    import torch.distributed._functional_collectives as funcol

    for name, key in (("all_gather_single", "tp_all_gathers"), ("reduce_scatter_single", "tp_reduce_scatters")):
        inner = getattr(funcol, name)
        now[key] = 0

        def counted(*args, _inner=inner, _key=key, **kwargs):
            now[_key] += 1
            return _inner(*args, **kwargs)

        setattr(funcol, name, counted)


def count_collectives(trainer) -> None:
    """Count, per training step, the calls FSDP2 makes to torch.distributed.all_gather_single and
    reduce_scatter_single (its collectives) on groups of two or more ranks, and the bytes each sends ((n - 1) / n
    of the whole tensor), so a test can hold the planner's schedule (moelab.planner.gathered) to them; and the
    all_to_all_single calls that move floating-point rows (the EP dispatchers' exchanges)."""
    import inspect

    import torch.distributed as dist

    now = {"all_gathers": 0, "reduce_scatters": 0, "all_gather_bytes": 0, "reduce_scatter_bytes": 0,
           "row_all_to_alls": 0}

    def spy(name, whole):
        inner = getattr(dist, name)
        sig = inspect.signature(inner)
        kind = "all_gather" if name == "all_gather_single" else "reduce_scatter"

        def counted(*args, **kwargs):
            bound = sig.bind(*args, **kwargs).arguments
            n = dist.get_world_size(bound.get("group"))
            if n > 1:
                t = bound[whole]
                now[f"{kind}s"] += 1
                now[f"{kind}_bytes"] += t.numel() * t.element_size() * (n - 1) // n
            return inner(*args, **kwargs)

        setattr(dist, name, counted)

    spy("all_gather_single", "output_tensor")
    spy("reduce_scatter_single", "input")
    inner_a2a = dist.all_to_all_single

    def counted_a2a(output, input, *args, **kwargs):
        # the EP dispatchers' exchanges of rows (floating point), not their split sizes (integers)
        now["row_all_to_alls"] += int(input.is_floating_point())
        return inner_a2a(output, input, *args, **kwargs)

    dist.all_to_all_single = counted_a2a
    count_dtensor_collectives(now)
    step_fn = trainer.train_step

    def counted_step(step, *args, **kwargs):
        for k in now:
            now[k] = 0
        out = step_fn(step, *args, **kwargs)
        COLLECTIVES.append(dict(now))
        return out

    trainer.train_step = counted_step


def main(run_dir: Path) -> None:
    record_allocation()
    if os.environ.get("TEST_TRITON_MIN_NUMEL"):
        from moelab.train.adamw_triton import TritonAdamW

        TritonAdamW.MIN_NUMEL = int(os.environ["TEST_TRITON_MIN_NUMEL"])
    cfg = load_config(run_dir / "config.yaml")
    wrong = os.environ.get("TEST_RANK_OVERRIDES")  # "RANK:key=value,...": a bug on one rank (the bounds' test)
    if wrong and int(os.environ.get("RANK", "0")) == int(wrong.split(":", 1)[0]):
        cfg = load_config(cfg, wrong.split(":", 1)[1].split(","))
    trainer = Trainer(cfg, run_dir)
    fault = os.environ.get("TEST_FAULT")
    if fault:
        rank, at_step, kind = fault.split(":")
        step_fn = trainer.train_step

        def faulty_step(step):
            if trainer.env.rank == int(rank) and step == int(at_step):
                if kind == "exit":
                    os._exit(13)
                time.sleep(3600)
            return step_fn(step)

        trainer.train_step = faulty_step
    count_collectives(trainer)
    env = trainer.env
    shutdown, env.shutdown = env.shutdown, lambda: None  # keep the process group for the gather below
    trainer.run()
    (run_dir / f"placement_rank{env.rank}.json").write_text(json.dumps({**placement(trainer.model, trainer.optimizer),
                                                                        "allocated": ALLOCATED,
                                                                        "loss_kind": getattr(trainer.model,
                                                                                             "loss_kind", None),
                                                                        "collectives": COLLECTIVES}))
    params = full_state_dict(trainer.par)
    if env.rank == 0:
        torch.save(params, run_dir / "params.pt")
    shutdown()


def run(argv: list[str]) -> None:
    """main(RUN_DIR), then end the process with its exit code as moelab.launch.entry ends a rank."""
    end_process(exit_code(lambda: main(Path(argv[0]))))


if __name__ == "__main__":
    run(sys.argv[1:])
