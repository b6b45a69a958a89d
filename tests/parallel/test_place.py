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
