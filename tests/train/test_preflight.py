"""moelab.train.preflight: the one set of checks before a rank starts (issue 30.4). A backend whose package is
missing is refused before submission where the ranks run on this machine, with its install hint, and nothing is
created; on the rank itself the same call refuses it."""
from __future__ import annotations

import pytest

from moelab import Session
from moelab.backends import BackendUnavailable, detected
from moelab.config import ConfigError
from moelab.train.preflight import preflight

from support import SMALL_CLI
from support import moelab_cli as moelab

DEEPEP = ["--set", "backend.dispatcher=deepep", "--set", "parallel.ep=2", "--set", "train.dtype=bfloat16"]
pytestmark = pytest.mark.skipif(detected()["deep_ep"], reason="DeepEP is installed here: nothing to refuse")


def deepep_session(**backend) -> Session:
    return Session("tiny", model={"num_layers": 2, "hidden_size": 32, "moe": {"num_experts": 4}},
                   train={"dtype": "bfloat16", "device": "cpu"}, parallel={"ep": 2},
                   backend={"dispatcher": "deepep", **backend})


def test_a_missing_deepep_is_refused_before_any_local_job_exists(tmp_path):
    d = tmp_path / "d"
    with pytest.raises(BackendUnavailable, match="backend.dispatcher='deepep': the package 'deep-ep' is not "
                                                 "installed .install: build DeepEP"):
        deepep_session().submit("local", nproc=2, folder=d)
    assert not d.exists()  # no folder, no job: it used to start two ranks that failed with a traceback
    out = moelab("run", "tiny", *SMALL_CLI, *DEEPEP, "--nproc", "2", "--out", d)
    assert out.returncode == 2 and "not installed" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not d.exists()


def test_preflight_is_the_same_call_for_every_caller():
    cfg = deepep_session().config
    for executor in ("inline", "local", "rank"):  # the ranks import the package on this machine
        with pytest.raises(BackendUnavailable, match="install"):
            preflight(cfg, 2, executor)
    assert preflight(cfg, 2, "slurm").ep == 2  # the nodes' environment decides, on the rank
    assert preflight(deepep_session(fallback=True).config, 2, "local").ep == 2  # the rank falls back, warned
    with pytest.raises(ConfigError, match=r"parallel.ep=2: must divide.*executor='local'"):
        preflight(cfg, 3, "local")
