"""backend.dispatcher=deepep on CPU: the layouts DeepEP's intranode kernels cannot take are refused when the config
is read (naming the field, the value and the fix), a missing package or GPU stops the run before it starts, and
moelab imports DeepEP only when a DeepEP dispatcher is built (the GPU side: gallery/scripts/deepep/check.py)."""
import subprocess
import sys

import pytest

from moelab.backends import BackendUnavailable, check_backends, detected
from moelab.config import ConfigError, load_config

OK = {"backend.dispatcher": "deepep", "parallel.ep": 2, "train.dtype": "bfloat16"}


def cfg(**over):
    return load_config("tiny", {**OK, **over})


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_intranode_ep_sizes_in_bf16_are_accepted(ep):
    assert cfg(**{"parallel.ep": ep}).backend.dispatcher == "deepep"


@pytest.mark.parametrize("over,field,value,fix", [
    ({"parallel.ep": 1}, "parallel.ep", "1", "set parallel.ep to one of [2, 4, 8]"),
    ({"parallel.ep": 16}, "parallel.ep", "16", "set parallel.ep to one of [2, 4, 8]"),
    ({"train.dtype": "float32"}, "train.dtype", "'float32'", "set train.dtype=bfloat16"),
    ({"parallel.data_parallel": "ddp"}, "parallel.data_parallel", "'ddp'", "parallel.data_parallel=fsdp"),
    ({"model.hidden_size": 72}, "model.hidden_size", "72", "a multiple of 16 and at most 8176"),
    ({"model.hidden_size": 8192}, "model.hidden_size", "8192", "a multiple of 16 and at most 8176"),
    ({"model.moe.num_experts": 64, "model.moe.top_k": 33}, "model.moe.top_k", "33", "at most 32 experts"),
])
def test_layouts_deepep_cannot_run_are_refused_with_the_fix(over, field, value, fix):
    with pytest.raises(ConfigError) as e:
        cfg(**over)
    msg = str(e.value)
    assert msg.startswith(f"{field}={value}") or f"{field}={value}:" in msg, msg
    assert fix in msg and "backend.dispatcher=all_to_all" in msg


def test_the_same_layouts_run_with_the_all_to_all_dispatcher():
    c = cfg(**{"parallel.ep": 1, "train.dtype": "float32", "backend.dispatcher": "all_to_all"})
    assert c.parallel.ep == 1


def test_missing_package_or_gpu_stops_the_run_before_it_starts(monkeypatch):
    import moelab.backends as backends

    if not detected()["deep_ep"]:
        with pytest.raises(BackendUnavailable, match="deep-ep.*not installed.*gallery/scripts/deepep"):
            check_backends(cfg(), device="cuda", world_size=2)
    monkeypatch.setitem(backends._DETECTED, "deep_ep", True)  # as if installed: the hardware check decides
    with pytest.raises(BackendUnavailable, match="this run is on 'cpu'.*backend.dispatcher='all_to_all'"):
        check_backends(cfg(), device="cpu", world_size=2)
    with pytest.warns(RuntimeWarning, match="falling back to backend.dispatcher='all_to_all'"):
        assert check_backends(cfg(**{"backend.fallback": True}), device="cpu", world_size=2)["dispatcher"] \
            == "all_to_all"


def test_building_the_dispatcher_without_the_package_names_it():
    if detected()["deep_ep"]:
        pytest.skip("deep_ep is installed here")
    from moelab.parallel.distributed import build_dispatcher

    with pytest.raises(BackendUnavailable, match="deep-ep"):
        build_dispatcher("deepep", group=None, hidden=64)


def test_deep_ep_is_imported_only_when_a_deepep_dispatcher_is_built():
    code = ("import sys, moelab.parallel.deepep, moelab.parallel.distributed, moelab.train.trainer\n"
            "from moelab.parallel.distributed import build_dispatcher\n"
            "assert 'deep_ep' not in sys.modules, 'deep_ep imported at module level'\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
