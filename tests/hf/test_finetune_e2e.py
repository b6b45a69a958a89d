"""Fine-tuning a released checkpoint, end to end (issue 24's done-when): a Qwen3-MoE checkpoint made with
transformers (with a chat tokenizer in its folder), an SFT run with LoRA from `hf:` it, then `moelab export`.
The run lowers the response loss (measured by transformers on the base and on the exported model), trains only
adapters (its checkpoint holds no base tensor; the base weights stay the checkpoint's), and the merged export
loads in transformers with moelab's logits; attention-only LoRA also exports as PEFT adapters."""
from __future__ import annotations

import shutil

import pytest
import torch

from moelab.config import ConfigError
from moelab.hf.example_checkpoint import make_qwen3_checkpoint, write_chats
from moelab.hf.source import load_config
from moelab.model.lora import is_adapter
from moelab.parallel.env import DistEnv
from moelab.data.sft import load_examples
from moelab.train.trainer import Trainer

transformers = pytest.importorskip("transformers")

STEPS = 16
SFT = {"data.kind": "sft", "train.steps": STEPS, "train.seq_len": 64, "train.global_batch_size": 4,
       "train.micro_batch_size": 2, "train.warmup_steps": 1, "train.lr": 0.02, "train.device": "cpu",
       "train.checkpoint_every": STEPS, "train.lora.rank": 8, "train.lora.alpha": 16}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    folder = make_qwen3_checkpoint(root / "base")["folder"]
    return folder, write_chats(root / "chats.jsonl", 48)


def train(cfg, run_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(cfg, run_dir, env=DistEnv())
        summary = trainer.run()
    finally:
        torch.set_num_threads(threads)
    assert summary["status"] == "COMPLETED"
    return trainer, summary


def response_loss(model, examples) -> float:
    """Mean cross entropy over the response tokens of `examples` (prompt tokens left out), in transformers."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            ids = torch.as_tensor(ex.ids_N)[None]
            logits = model(ids).logits[0, :-1].float()
            mask = torch.as_tensor(ex.response_N[1:])
            loss = torch.nn.functional.cross_entropy(logits[mask], ids[0, 1:][mask], reduction="sum")
            total, count = total + loss.item(), count + int(mask.sum())
    return total / count


def hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def checkpoint_tensors(run) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    from moelab.contract.checkpoints import latest_checkpoint

    names = FileSystemReader(str(latest_checkpoint(run))).read_metadata().state_dict_metadata
    return {n.removeprefix("model.") for n in names if n.startswith("model.")}


def restored(cfg, run, tmp_path):
    """moelab's trained model as a resume on one process restores it (on a copy of the run)."""
    copy = tmp_path / "restored"
    shutil.copytree(run, copy)
    t = Trainer(cfg.replace(parallel={"ep": 1, "fsdp": -1}), copy, env=DistEnv())
    t.setup()
    return t.model.eval()


def test_lora_sft_from_hf_lowers_the_response_loss_and_exports_moelabs_logits(ckpt, tmp_path):
    from moelab.cli import main
    from moelab.hf import load_hf

    base, data = ckpt
    cfg = load_config(f"hf:{base}", {**SFT, "data.path": str(data), "train.lora.targets": "attention,experts"})
    assert cfg.data.tokenizer == "bytes"  # not given: the checkpoint folder's tokenizer renders the chats
    run = tmp_path / "run"
    trainer, summary = train(cfg, run)
    assert summary["final_loss"] < summary["first_loss"]

    # only adapters trained: the checkpoint holds adapters (and routers' buffers), no base weight
    saved = checkpoint_tensors(run)
    assert any(is_adapter(n) for n in saved) and any("lora_a_gate_up" in n for n in saved)
    base_state = load_hf(base).state_dict()
    assert not saved & {n for n, t in base_state.items() if t.is_floating_point() and "router" not in n}
    trained = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(is_adapter(n) for n in trained)
    state = trainer.model.state_dict()
    for name, want in base_state.items():  # the frozen base is still the checkpoint's
        torch.testing.assert_close(state[name], want, rtol=0, atol=0, msg=name)

    out = tmp_path / "hf"
    assert main(["export", str(run), "--to", "hf", str(out)]) == 0
    assert (out / "tokenizer.json").is_file()  # the base's tokenizer goes along
    tuned = hf_model(out)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = restored(cfg, run, tmp_path)(ids), tuned(ids).logits
    scale = ours.abs().max().item()
    assert (theirs - ours).abs().max().item() <= 1e-4 * scale
    with torch.no_grad():  # the adapters moved the model: the export is not the base
        assert (hf_model(base)(ids).logits - theirs).abs().max().item() > 1e-3 * scale

    examples = load_examples(cfg)
    before, after = response_loss(hf_model(base), examples), response_loss(tuned, examples)
    assert after < 0.75 * before, (before, after)


def test_attention_lora_exports_peft_adapters_with_moelabs_logits(ckpt, tmp_path):
    peft = pytest.importorskip("peft")
    from moelab.cli import main

    base, data = ckpt
    cfg = load_config(f"hf:{base}", {**SFT, "data.path": str(data), "train.steps": 3,
                                     "train.checkpoint_every": 3, "train.lora.targets": "attention"})
    run = tmp_path / "run"
    train(cfg, run)
    out = tmp_path / "peft"
    assert main(["export", str(run), "--to", "hf", str(out), "--lora", "adapters"]) == 0
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    model = peft.PeftModel.from_pretrained(hf_model(base), str(out)).eval()
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours, theirs = restored(cfg, run, tmp_path)(ids), model(ids).logits
    assert (theirs - ours).abs().max().item() <= 1e-4 * ours.abs().max().item()


@pytest.mark.slow
def test_lora_sft_from_hf_on_ep2_gives_the_one_process_losses(ckpt, tmp_path):
    """EP=2 on gloo: each rank reads its experts from the checkpoint and trains their adapters; the losses are
    the one-process run's."""
    from moelab.launch.local import run_local_processes
    from moelab.contract.stream import read_events

    base, data = ckpt
    over = {**SFT, "data.path": str(data), "train.steps": 4, "train.checkpoint_every": 0,
            "train.lora.targets": "attention,experts"}
    one, two = tmp_path / "one", tmp_path / "two"
    train(load_config(f"hf:{base}", over), one)
    cfg = load_config(f"hf:{base}", {**over, "parallel.ep": 2})
    assert run_local_processes(cfg, two, 2)["status"] == "COMPLETED"
    losses = [[e["loss"] for e in read_events(r / "metrics.jsonl") if e["event"] == "step"] for r in (one, two)]
    assert len(losses[0]) == 4
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5, atol=0)


def test_sft_from_hf_without_tokenizer_files_is_refused_naming_data_tokenizer(tmp_path):
    from moelab.data.batches import check_data

    base = make_qwen3_checkpoint(tmp_path / "bare", tokenizer=False)["folder"]
    data = write_chats(tmp_path / "chats.jsonl", 4)
    cfg = load_config(f"hf:{base}", {**SFT, "data.path": str(data)})
    with pytest.raises(ConfigError, match=r"data.tokenizer='bytes'.*has no tokenizer files.*data.tokenizer=FOLDER"):
        check_data(cfg)
    with pytest.raises(ConfigError, match="data.tokenizer='bytes'.*or start from hf:PATH"):  # no hf: base
        load_config("tiny", {**SFT, "data.path": str(data)})
