"""The planner's activation term (moelab.planner.recompute): what checkpointing keeps is held once per micro
batch in flight, the recompute working set once per rank (a pipeline rank runs one backward at a time); the
selective policy keeps less than no recompute and more than full."""
from moelab.config import load_config
from moelab.planner.plan import plan
from moelab.planner.saved import saved_per_token
from moelab.planner.recompute import layer_activations, selective_kept_per_token

PP = {"model.num_layers": 8, "parallel.pp": 4, "parallel.pp_schedule": "gpipe", "train.micro_batch_size": 1,
      "train.dtype": "bfloat16"}


def _acts(mode: str, batches: int) -> int:
    cfg = load_config("tiny", {**PP, "train.activation_checkpointing": mode, "train.global_batch_size": batches})
    p = plan(cfg, gpus=4)
    assert p.pipeline["in_flight_micro_batches"] == batches  # GPipe: every micro batch of the step
    return p.memory["activations"], p


def test_the_recompute_working_set_is_counted_once_not_per_micro_batch_in_flight():
    cfg = load_config("tiny", PP)
    T = cfg.train.seq_len
    for mode in ("full", "selective", "none"):
        four, p = _acts(mode, 4)
        eight, _ = _acts(mode, 8)
        acts = [saved_per_token(cfg, i >= cfg.model.num_dense_layers, 2) for i in range(8)]
        kept = [selective_kept_per_token(cfg, i >= cfg.model.num_dense_layers, 2, True) for i in range(8)]
        held, working = layer_activations(cfg, acts, kept, p.stage_layers[p.stage], T)[mode]
        if p.stage == 3:  # the last stage also holds the final norm's tensors
            held += T * cfg.model.hidden_size * (4 + 2 * 2)
        assert four == 4 * held + working and eight - four == 4 * held, mode  # four more micro batches: held only
        assert (working == 0) == (mode == "none")


def test_selective_keeps_less_than_none_and_more_than_full_per_block():
    cfg = load_config("qwen3-moe-30b-a3b", {"train.dtype": "bfloat16"})
    per = saved_per_token(cfg, True, 2)
    kept = selective_kept_per_token(cfg, True, 2, True)
    assert per["input"] < kept < per["attention"] + per["ffn"]
