"""Rank side of test_deepep_dispatcher.py: moelab's DeepEP dispatcher on the CPU stand-in of deep_ep
(deepep_standin.py) against the all-to-all dispatcher, through the comparison gallery/scripts/deepep/check.py
makes on the GPUs (the same random routing, top-2 and top-8 with dropped assignments).

    python deepep_worker.py OUT_DIR      (2 ranks, started by moelab.launch.local.launch)
"""
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import deepep_standin  # noqa: E402

sys.modules["deep_ep"] = deepep_standin
from moelab.backends import packages  # noqa: E402

packages._DETECTED["deep_ep"] = True  # this process only: the stand-in plays the package

import moelab.parallel.deepep as deepep_module  # noqa: E402
from moelab.config import ConfigError  # noqa: E402
from moelab.launch.entry import end_process  # noqa: E402
from moelab.parallel.deepep import DeepEPDispatcher, close_dispatchers  # noqa: E402
from moelab.parallel.expert_parallel import AllToAllDispatcher  # noqa: E402


def main(out: Path) -> None:
    spec = importlib.util.spec_from_file_location("deepep_check", HERE.parents[1] / "gallery/scripts/deepep/check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    dist.init_process_group("gloo")
    rank, ep = dist.get_rank(), dist.get_world_size()
    a2a, dpe = AllToAllDispatcher(dist.group.WORLD), DeepEPDispatcher(dist.group.WORLD, hidden=512)
    result = check.compare(a2a, dpe, rank, ep, device="cpu")
    result["dispatch_counts"] = {"all_to_all": a2a.counts.pop(), "deepep": dpe.counts.pop()}
    buffer = dpe.buffer
    layers = [SimpleNamespace(dispatcher=d) for d in (dpe, dpe, a2a)]  # one dispatcher serves every layer
    close_dispatchers(layers)  # the stand-in's destroy refuses a second call
    result["closed"] = dpe.buffer is None and buffer.destroyed
    # EP ranks on two hosts: refused before any buffer is made (DeepEP's intranode kernels need one node)
    deepep_module.socket.gethostname = lambda: f"node{rank}"
    try:
        DeepEPDispatcher(dist.group.WORLD, hidden=512)
        result["two_hosts"] = "accepted"
    except ConfigError as e:
        result["two_hosts"] = str(e)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    end_process(0)  # as dispatch_worker.py: not through the interpreter's teardown, where gloo's workers abort it


if __name__ == "__main__":
    main(Path(sys.argv[1]))
