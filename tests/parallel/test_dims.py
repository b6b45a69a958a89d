"""The one layout validator (moelab.layout.dims.ParallelDims): torch-free, and asked by the planner,
Session.submit, the `moelab` command and the trainer, so a layout the ranks cannot run is refused before
anything is submitted, with the field, the value and the fix."""
import subprocess
import sys

import pytest

from moelab import Session
from moelab.config import ConfigError, load_config
from moelab.layout.dims import ParallelDims, coords_of
from moelab.planner.plan import plan

# layouts the ranks reject (torch's schedules, the CP/PP composition), each with the field its error names
RANK_REJECTED = {
    "vp2-with-1f1b": (["parallel.pp=2", "parallel.vp=2", "parallel.pp_schedule=1f1b", "train.micro_batch_size=2"],
                      4, "parallel.pp_schedule='1f1b'"),
    "cp2-with-pp2": (["parallel.pp=2", "parallel.cp=2", "train.micro_batch_size=2"], 4, "parallel.cp=2 with parallel.pp=2"),
}


def test_importable_without_torch():
    code = ("import sys; import moelab.layout.dims, moelab.planner.plan; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name", RANK_REJECTED)
def test_rank_rejected_layouts_are_refused_by_every_asker(name, tmp_path):
    overrides, world, field = RANK_REJECTED[name]
    cfg = load_config("tiny", overrides)
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        ParallelDims.build(cfg, world)
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        plan(cfg, gpus=world)
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):  # before any folder or job exists
        Session(cfg).submit("local", nproc=world, folder=tmp_path / "r")
    assert not (tmp_path / "r").exists()
    r = subprocess.run([sys.executable, "-m", "moelab", "run", "tiny", *sum((["--set", o] for o in overrides), []),
                        "--nproc", str(world), "--out", str(tmp_path / "cli")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and field in r.stderr, r.stderr
    assert not (tmp_path / "cli").exists()


def test_the_dims_hold_the_mesh_shapes_and_rank_order():
    dims = ParallelDims.build(load_config("tiny", ["parallel.pp=2", "parallel.ep=2", "train.micro_batch_size=2",
                                               "train.global_batch_size=32"]), 8)
    assert (dims.pp, dims.dp, dims.cp, dims.ep) == (2, 4, 1, 2)
    assert dims.world_shape == (2, 4, 1, 1) and dims.dense_shape == (2, 4, 1) and dims.expert_shape == (2, 2, 2)
    assert dims.num_stages == 2 and dims.n_microbatches == 32 // (2 * 4)
    # pipeline stage outermost, EP peers neighbours
    assert [(dims.coords(r).pp, dims.coords(r).ep) for r in range(4)] == [(0, 0), (0, 1), (0, 0), (0, 1)]
    assert dims.coords(5) == coords_of(dims.layout, 5) and dims.coords(5).pp == 1


def test_fsdp_minus_one_fills_the_world():
    assert ParallelDims.build(load_config("tiny", ["train.micro_batch_size=2"]), 4).layout.fsdp == 4
    with pytest.raises(ConfigError, match="parallel.fsdp=3"):
        ParallelDims.build(load_config("tiny", ["parallel.fsdp=3"]), 4)


def test_tensor_parallel_ranks_are_innermost_and_lend_ep():
    """TP peers are neighbours; EP is carved from fsdp*cp*tp, borrowing the TP ranks first (torchtitan's order);
    the MoE layer's expert-FSDP and token meshes span the TP ranks."""
    dims = ParallelDims.build(load_config("tiny", ["parallel.tp=2", "parallel.ep=2", "train.micro_batch_size=2"]), 8)
    assert (dims.tp, dims.dp, dims.ep) == (2, 4, 2)
    assert dims.world_shape == (1, 4, 1, 2) and dims.dense_shape == (1, 4, 2) and dims.expert_shape == (1, 4, 2)
    assert dims.token_shape == (1, 4, 2)
    coords = [dims.coords(r) for r in range(8)]
    assert [(c.dp, c.tp) for c in coords] == [(d, t) for d in range(4) for t in range(2)]
    assert [c.ep for c in coords] == [0, 1] * 4 and [c.efsdp for c in coords] == [0, 0, 1, 1, 2, 2, 3, 3]
    # ep=4 spans two data-parallel ranks' TP pairs
    dims4 = ParallelDims.build(load_config("tiny", ["parallel.tp=2", "parallel.ep=4", "train.micro_batch_size=2"]), 8)
    assert [dims4.coords(r).ep for r in range(8)] == [0, 1, 2, 3] * 2 and dims4.expert_shape == (1, 2, 4)


@pytest.mark.parametrize("overrides, field", [
    (["parallel.tp=8"], "model.num_heads"),  # tiny: 4 query heads
    (["parallel.tp=4", "model.num_kv_heads=2"], "model.num_kv_heads"),
    (["parallel.tp=2", "model.vocab_size=255"], "model.vocab_size"),
    (["parallel.tp=2", "model.dense_ffn_size=191"], "model.dense_ffn_size"),
    (["parallel.tp=2", "train.seq_len=63"], "train.seq_len"),
])
def test_tensor_parallel_divisibility_names_the_split(overrides, field):
    cfg = load_config("tiny", overrides)
    with pytest.raises(ConfigError, match=f"parallel.tp.*{field}"):
        ParallelDims.build(cfg, 8)


@pytest.mark.parametrize("override, field", [
    ("parallel.data_parallel=ddp", "parallel.data_parallel"), ("backend.loss=liger", "backend.loss"),
    ("backend.attention=te", "backend.attention"),
])
def test_tensor_parallel_refuses_what_it_does_not_run_yet(override, field):
    with pytest.raises(ConfigError, match=f"{field}.*parallel.tp=2"):
        load_config("tiny", ["parallel.tp=2", override])
