"""moelab's DeepEP dispatcher against the all-to-all dispatcher on two gloo ranks, on a CPU stand-in of deep_ep's
intranode Buffer (deepep_standin.py: DeepEP's Python contract and host checks, not its kernels): the experts get
the same rows in the same order with the same counts, and the combined output and the gradients of the tokens,
the router weights and the experts agree; the dispatch counts in the metrics are the same; the buffer is freed
once at the end; EP ranks on two hosts are refused. On the GPUs the same comparison runs on DeepEP itself
(gallery/scripts/deepep/check.py)."""
import json
import sys
from pathlib import Path

import pytest

from moelab.launch.local import launch

HERE = Path(__file__).parent


@pytest.mark.slow
def test_deepep_dispatcher_matches_all_to_all_on_the_standin(tmp_path):
    launch([sys.executable, str(HERE / "deepep_worker.py"), str(tmp_path)], 2, tmp_path / "logs")
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case in ("top2", "top8-capacity"):
            r = res[case]
            assert r["rows_equal"] and r["counts_equal"], (rank, case, r)
            # bf16: DeepEP's combine writes each token's sum over ranks in bf16 (all_to_all keeps fp32)
            for k in ("y", "x_grad", "w_grad", "scale_grad"):
                assert r[f"{k}_rel_diff"] <= 2e-2, (rank, case, k, r)
            assert r["passed"]
        counts = res["dispatch_counts"]
        assert counts["deepep"] == counts["all_to_all"] and counts["deepep"]["dispatch_rows"][0] > 0
        assert res["closed"]  # the buffer is freed once, by every rank (close_dispatchers at a run's end)
        assert "hosts ['node0', 'node1']" in res["two_hosts"] and "backend.dispatcher=all_to_all" in res["two_hosts"]
