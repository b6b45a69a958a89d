"""Every row of the reference table, as its gallery entry is written (published layout and global batch,
moelab's recommended settings), plans at or under 72 GiB per 80 GB H100: 10% to spare."""
import pytest

from moelab.gallery import get_entry
from moelab.planner.plan import plan
from moelab.planner.units import GiB

ROWS = ["qwen3-moe-30b-a3b-8gpu", "deepseek-v3-256gpu", "kimi-k2-256gpu", "gpt-oss-120b-64gpu",
        "gpt-oss-20b-8gpu", "deepseek-v3-1024gpu"]


@pytest.mark.parametrize("name", ROWS)
def test_each_reference_row_plans_within_72_gib_of_an_h100(name):
    e = get_entry(name)
    cfg = e.config()
    assert cfg.train.compile and cfg.train.optimizer_state == "bf16_moments"
    p = plan(cfg, gpus=e.gpus, gpu_memory_gb=80)
    assert p.fits and p.memory_per_gpu_bytes <= 72 * GiB, (name, p.memory_per_gpu_bytes / GiB, p.memory)
