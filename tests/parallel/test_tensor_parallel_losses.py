"""Tensor parallelism with the fused chunked loss, a padding id and packed SFT batches (moelab.parallel.tensor,
moelab.backends.vocab_parallel) on gloo processes reproduces the single-process run: losses, routing counts, aux
losses, gradient norms and parameters after 4 AdamW steps, within test_tensor_parallel's bounds (what TP changes
is the order of fp32 sums: the log-sum-exp over the vocabulary combined from per-shard maxima and sums, the
hidden gradient summed over the ranks' vocabulary rows, the masked router means summed over the sequence
shards; see that module's docstring for the parameter bounds).
"""
import importlib.util
import json
from pathlib import Path

import pytest

from moelab.config import ConfigError, load_config
from moelab.contract.stream import read_events

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("tensor_parallel_layouts",
                                               Path(__file__).with_name("test_tensor_parallel.py"))
TP = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(TP)  # its SHARED overrides, bounds (LR) and step comparison
SHARED = TP.SHARED
PAD = 168  # a token of the synthetic data (it occurs on both sequence halves) in rank 1's vocabulary rows
# name: (processes, overrides of the reference and the TP run alike, TP layout)
LAYOUTS = {
    # micro batches of 64 tokens in chunks of 24: three chunks, the last one short; evaluated without gradients
    "tp2-chunked": (2, ("backend.loss=chunked", "backend.loss_chunk_tokens=24", "train.eval_every=2",
                        "train.eval_batches=2"), ["parallel.tp=2"]),
    "tp2-full": (2, ("backend.loss=full",), ["parallel.tp=2"]),
    "tp2-pad": (2, (f"model.pad_token_id={PAD}",), ["parallel.tp=2"]),
    "tp2-pad-full": (2, (f"model.pad_token_id={PAD}", "backend.loss=full"), ["parallel.tp=2"]),
    "tp2xep2-pad": (4, (f"model.pad_token_id={PAD}", "backend.loss_chunk_tokens=24"),
                    ["parallel.tp=2", "parallel.ep=2"]),
}


def check_reproduces(ref, run, helpers):
    """test_tensor_parallel's checks: losses, routing counts, aux losses, gradient norms, parameters."""
    (ref_losses, ref_params, ref_dir), (losses, params, run_dir) = ref, run
    TP.assert_same_steps(losses, run_dir, ref_losses, ref_dir, helpers)
    ref_ev, ev = helpers.step_events(ref_dir), helpers.step_events(run_dir)
    assert [e["routing"]["routed_per_expert"] for e in ev] == [e["routing"]["routed_per_expert"] for e in ref_ev]
    helpers.assert_within(params, ref_params, None, max_abs=TP.LR / 3, max_rel=2e-3)
    evals = [[e["loss"] for e in read_events(Path(d) / "metrics.jsonl") if e["event"] == "eval"]
             for d in (ref_dir, run_dir)]
    assert evals[1] == pytest.approx(evals[0], rel=1e-5)


def run_layout(name, reference, helpers, tmp_path):
    nproc, common, layout = LAYOUTS[name]
    ref = reference(*SHARED, *common)
    losses, params = helpers.run_multi(helpers.small_config(*SHARED, *common, *layout), tmp_path, nproc)
    check_reproduces(ref, (losses, params, tmp_path), helpers)
    return ref, params, json.loads((tmp_path / "placement_rank0.json").read_text())


@pytest.mark.parametrize("name", LAYOUTS)
def test_tensor_parallel_losses_reproduce_single_process(name, reference, helpers, tmp_path):
    ref, params, placed = run_layout(name, reference, helpers, tmp_path)
    kind = "full" if name.endswith("-full") else "chunked"  # backend.loss=auto takes chunked on the CPU
    assert placed["loss_kind"] == kind
    if name == "tp2-chunked":
        assert len([e for e in read_events(tmp_path / "metrics.jsonl") if e["event"] == "eval"]) == 2
    if "pad" in name:  # the padding row: zero at init, no gradient, so zero after training, as in one process
        assert params["tok_embeddings.weight"][PAD].abs().max().item() == 0.0
        assert ref[1]["tok_embeddings.weight"][PAD].abs().max().item() == 0.0


def test_auto_resolves_to_the_chunked_loss_and_the_other_fused_losses_are_refused():
    """backend.loss=auto resolves under TP as documented (compile is refused there: the chunked loss); the
    library kernels (liger, cce) are refused with the reason."""
    from moelab.planner.plan import resolve_loss

    for on_cuda in (False, True):
        assert resolve_loss(load_config("tiny", ["parallel.tp=2"]), gpus=2, on_cuda=on_cuda) == "chunked"
    load_config("tiny", ["parallel.tp=2", "backend.loss=chunked"])
    load_config("tiny", ["parallel.tp=2", "backend.loss=full"])
    for kind in ("liger", "cce"):
        with pytest.raises(ConfigError, match=f"backend.loss='{kind}'.*parallel.tp=2.*whole vocabulary"):
            load_config("tiny", ["parallel.tp=2", f"backend.loss={kind}"])


def _sft_helpers():
    """tests/train/test_sft.py's tokenizer, records and config (pytest imports test files by path)."""
    path = Path(__file__).parents[1] / "train" / "test_sft.py"
    spec = importlib.util.spec_from_file_location("_test_sft_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("loss", ["chunked", "full"])
def test_packed_sft_batches_reproduce_single_process(loss, helpers, tmp_path):
    """Packed chats under TP: the attention gathers the whole sequence with its document ids and restarting
    positions, the MoE layer routes its sequence shard with that shard's columns of the padding mask, the loss
    leaves out the prompt and padding targets (-100) on the vocabulary-sharded head."""
    sft = _sft_helpers()
    tok = sft.make_tokenizer(tmp_path / "tok")
    data = sft.write_jsonl(tmp_path / "d.jsonl", sft.arithmetic(24))
    cfg = sft.sft_config(data, tok, *SHARED, "train.steps=4", "train.warmup_steps=1", f"backend.loss={loss}",
                         "backend.loss_chunk_tokens=48", "train.save_checkpoints=false")
    assert cfg.data.sft_packing
    ref_losses, ref_params = helpers.run_single(cfg, tmp_path / "one")
    losses, params = helpers.run_multi(cfg.replace(**{"parallel.tp": 2}), tmp_path / "tp2", 2)
    check_reproduces((ref_losses, ref_params, tmp_path / "one"), (losses, params, tmp_path / "tp2"), helpers)
    routed = [sum(layer) for e in helpers.step_events(tmp_path / "tp2") for layer in e["routing"]["routed_per_expert"]]
    assert max(routed) < 8 * 64 * cfg.model.moe.top_k, "the batches hold padding, left out of the routing counts"
