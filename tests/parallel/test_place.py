"""moelab.parallel.place.materialize: bf16 parameters are allocated in bf16 (never an fp32 copy of the model on
the device) with the values an fp32 init rounded to bf16 gives."""
import pytest
import torch

from moelab.config import load_config
from moelab.model import MoETransformer
from moelab.model.lora import apply_lora
from moelab.parallel.place import materialize


def _placed(cfg, spy=None):
    with torch.device("meta"):
        model = MoETransformer(cfg.model, cfg.backend)
    if cfg.train.lora.rank:
        apply_lora(model, cfg)
    if spy is not None:
        to_empty = model.to_empty
        model.to_empty = lambda **kw: (spy.extend(p.dtype for p in model.parameters()), to_empty(**kw))[1]
    materialize(model, cfg, "cpu")
    return model


@pytest.mark.parametrize("extra", [[], ["train.lora.rank=4", "train.lora.targets=attention,experts"]])
def test_bf16_parameters_are_allocated_in_bf16_with_the_fp32_inits_values(extra):
    fp32 = _placed(load_config("tiny", extra))
    dtypes = []
    bf16 = _placed(load_config("tiny", extra + ["train.dtype=bfloat16", "train.param_dtype=bfloat16"]), spy=dtypes)
    assert dtypes and set(dtypes) == {torch.bfloat16}  # what to_empty allocates
    for (name, a), (_, b) in zip(fp32.named_parameters(), bf16.named_parameters()):
        assert b.dtype == torch.bfloat16, name
        assert torch.equal(a.to(torch.bfloat16), b), name
    for (name, a), (_, b) in zip(fp32.named_buffers(), bf16.named_buffers()):
        assert a.dtype == b.dtype and torch.equal(a, b), name  # buffers (router state, rotary) stay as they were


WORKER = """
import sys, torch
from moelab.config import load_config
from moelab.model import MoETransformer
from moelab.parallel.apply import parallelize
from moelab.layout.dims import ParallelDims
from moelab.parallel.distributed import full_state_dict
from moelab.parallel.env import DistEnv

cfg = load_config("tiny", sys.argv[2:])
env = DistEnv.from_environ("cpu")
env.init()
with torch.device("meta"):
    model = MoETransformer(cfg.model, cfg.backend)
par = parallelize(model, cfg, env, ParallelDims.build(cfg, env.world_size))
dtypes = sorted({str(p.dtype) for p in par.model.parameters()})
full = full_state_dict(par)
if env.rank == 0:
    torch.save({"dtypes": dtypes, "params": full}, sys.argv[1])
env.shutdown()
# as a moelab rank ends (moelab.launch.entry.end_process): not through the interpreter's teardown, which races the
# gloo threads torch keeps after destroy_process_group (SIGABRT, "terminate called without an active exception")
from moelab.launch.entry import end_process
end_process(0)
"""


@pytest.mark.parametrize("layout", [["parallel.fsdp=2"], ["parallel.ep=2"]])
def test_two_ranks_place_bf16_shards_with_the_one_process_values(layout, tmp_path):
    """FSDP2 wraps the meta-device model in bf16 and each of 2 gloo ranks draws only its rows: the gathered
    parameters are bf16 on every rank and equal, bit for bit, one process's bf16 placement."""
    import subprocess
    import sys

    from moelab.launch.local import free_port, rank_env

    overrides = ["train.dtype=bfloat16", "train.param_dtype=bfloat16", *layout]
    out = tmp_path / "placed.pt"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(out), *overrides], env=rank_env(r, 2, port),
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs[0][-3000:] + errs[1][-3000:]
    placed = torch.load(out)
    assert placed["dtypes"] == ["torch.bfloat16"]
    one = _placed(load_config("tiny", overrides))
    for name, p in one.named_parameters():
        assert torch.equal(placed["params"][name], p.float()), name
