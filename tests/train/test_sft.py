"""Instruction data (data.kind: sft): rendering against transformers' apply_chat_template, loss masks computed
by hand, packed attention against each example alone on every backend that packs, a run that lowers the
response loss, a resume, one process against FSDP=2 (gloo), and bad input refused before a step runs.

The tokenizer is made on the spot: a byte-level BPE (tokenizers) with a ChatML jinja template, saved with
transformers' save_pretrained."""
import json
import os
from pathlib import Path

import pytest
import torch

from moelab.config import ConfigError, load_config
from moelab.launch.local import run_local_processes
from moelab.model import MoETransformer
from moelab.model.attention import set_documents
from moelab.parallel.env import DistEnv
from moelab.data.batches import check_data
from moelab.backends.full_loss import IGNORE_INDEX
from moelab.contract.stream import read_events
from moelab.data.sft import load_chat_tokenizer, render
from moelab.data.sft_batches import SFTData
from moelab.train.trainer import Trainer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 288  # the tokenizer's 285 ids fit


def make_tokenizer(folder: Path, template: str | None = CHATML) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["what is two plus two? four. the cat sat on the mat."] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if template:
        fast.chat_template = template
    fast.save_pretrained(str(folder))
    return folder


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def arithmetic(n: int) -> list[dict]:
    """Short chats with a learnable answer: pairs and two-turn chats (loss on both assistant turns)."""
    out = []
    for i in range(n):
        a, b = i % 7, (3 * i) % 5
        if i % 2:
            out.append({"prompt": f"{a}+{b}", "response": f"{a + b}"})
        else:
            out.append({"messages": [{"role": "user", "content": f"{a}+{b}"},
                                     {"role": "assistant", "content": f"{a + b}"},
                                     {"role": "user", "content": "cat?"},
                                     {"role": "assistant", "content": "mat."}]})
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def sft_config(data: Path, tok: Path, *overrides):
    return load_config("tiny", ["data.kind=sft", f"data.path={data}", f"data.tokenizer={tok}",
                                f"model.vocab_size={VOCAB}", "model.num_layers=2", "train.seq_len=64",
                                "train.global_batch_size=8", "train.micro_batch_size=2", "train.device=cpu",
                                *overrides])


# ---------------------------------------------------------------------------------------------- rendering
CHATS = [
    [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "four."}],
    [{"role": "system", "content": "be short"}, {"role": "user", "content": "the cat?"},
     {"role": "assistant", "content": "sat."}, {"role": "user", "content": "on?"},
     {"role": "assistant", "content": "the mat."}],
]


@pytest.mark.parametrize("chat", CHATS, ids=["one-turn", "multi-turn"])
def test_rendering_equals_apply_chat_template_and_masks_every_assistant_turn(tok_dir, chat):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    ex = render(tok, chat)
    expected = tok.apply_chat_template(chat, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ex.ids_N.tolist() == list(expected)
    # by hand: ChatML pieces, each tokenised alone (the special tokens and "\n" split the text there); the
    # response of each assistant turn is its content, <|im_end|> and the newline after it
    ids, response = [], []
    for m in chat:
        for piece, is_response in (("<|im_start|>", False), (f"{m['role']}\n", False),
                                   (m["content"], m["role"] == "assistant"),
                                   ("<|im_end|>", m["role"] == "assistant"), ("\n", m["role"] == "assistant")):
            piece_ids = tok(piece, add_special_tokens=False)["input_ids"]
            ids += piece_ids
            response += [is_response] * len(piece_ids)
    assert ex.ids_N.tolist() == ids
    assert ex.response_N.tolist() == response
    assert tok.decode(ex.ids_N[ex.response_N].tolist()) == "".join(
        f"{m['content']}<|im_end|>\n" for m in chat if m["role"] == "assistant")


# Qwen3's way: the last assistant turn gets an empty think block, earlier ones do not (so a turn renders
# differently once later turns follow it)
LAST_TURN_THINKS = ("{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}<|im_start|>assistant\n"
                    "<think>\n\n</think>\n\n{{ m['content'] }}<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
                    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_the_last_turn_differently_still_masks_each_turn(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    tok.chat_template = LAST_TURN_THINKS
    chat = CHATS[1]
    ex = render(tok, chat)
    expected = tok.apply_chat_template(chat, tokenize=True)
    assert ex.ids_N.tolist() == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert tok.decode(ex.ids_N[ex.response_N].tolist()) == (
        "sat.<|im_end|>\n" "<think>\n\n</think>\n\nthe mat.<|im_end|>\n")
    # the response tokens are two runs: each turn's, nothing of the prompts between
    runs = (ex.response_N[1:] & ~ex.response_N[:-1]).sum() + ex.response_N[0]
    assert runs == 2


def test_prompt_response_pair_is_a_user_and_an_assistant_message(tok_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "what is two plus two?", "response": "four."}])
    d = SFTData(sft_config(data, tok_dir, "data.sft_packing=false", "train.micro_batch_size=1",
                           "train.global_batch_size=1"))
    tok = d.chat_tokenizer
    assert d.examples[0].ids_N.tolist() == render(tok, CHATS[0]).ids_N.tolist()


# ---------------------------------------------------------------------------------------------- loss masks
def test_targets_are_the_response_tokens_only_computed_by_hand(tok_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "two plus two?", "response": "four."}])
    cfg = sft_config(data, tok_dir, "train.micro_batch_size=1", "train.global_batch_size=1")
    d = SFTData(cfg)
    tok = d.chat_tokenizer
    prompt = tok("<|im_start|>user\ntwo plus two?<|im_end|>\n<|im_start|>assistant\n",
                 add_special_tokens=False)["input_ids"]
    answer = tok("four.<|im_end|>\n", add_special_tokens=False)["input_ids"]
    ids = prompt + answer
    b = d.micro_batch(1, 0, 1)
    n = len(ids) - 1
    L = b.inputs_BL.shape[1]
    assert L == 16 * -(-n // 16), "the micro batch is as long as its row, rounded up to 16"
    assert b.inputs_BL[0, :n].tolist() == ids[:-1]
    # target t is token t+1: the first len(prompt)-1 targets are prompt tokens, then the answer's
    assert b.targets_BL[0].tolist() == [IGNORE_INDEX] * (len(prompt) - 1) + answer + [IGNORE_INDEX] * (L - n)
    assert b.valid_BL[0].tolist() == [True] * n + [False] * (L - n)
    assert b.positions_BL[0, :n].tolist() == list(range(n)) and b.documents_BL[0, :n].tolist() == [0] * n


def test_packing_restarts_positions_and_numbers_documents(tok_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", arithmetic(16))
    d = SFTData(sft_config(data, tok_dir, "train.seq_len=128"))
    lengths = [ex.positions for ex in d.examples]
    b = d.micro_batch(1, 0, 2)
    for r, row in enumerate([d.row(1, 0), d.row(1, 1)]):
        assert len(row) > 1, "short examples share a row"
        assert sum(lengths[i] for i in row) <= 128
        at = 0
        for doc, i in enumerate(row):
            n = lengths[i]
            assert b.positions_BL[r, at:at + n].tolist() == list(range(n))
            assert (b.documents_BL[r, at:at + n] == doc).all()
            assert b.inputs_BL[r, at:at + n].tolist() == d.examples[i].ids_N[:-1].tolist()
            at += n
        assert not b.valid_BL[r, at:].any() and (b.targets_BL[r, at:] == IGNORE_INDEX).all()
    # every example is in some row of every epoch's micro batches
    seen = {i for mb in d.micro_batches for row in mb for i in row}
    assert seen == set(range(16))


def test_order_is_seeded_layout_free_and_each_epoch_visits_every_micro_batch(tok_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", arithmetic(40))
    cfg = sft_config(data, tok_dir, "data.sft_packing=false")
    a, b = SFTData(cfg), SFTData(cfg)
    batches = len(a.micro_batches)
    steps = 3 * batches * 2 // 8  # three epochs of micro batches of 2 rows, 8 rows a step
    rows_a = [a.row(s, i) for s in range(1, steps + 1) for i in range(8)]
    backwards = {(s, i): b.row(s, i) for s in range(steps, 0, -1) for i in range(8)}  # a resume's order
    assert rows_a == [backwards[s, i] for s in range(1, steps + 1) for i in range(8)]
    epoch = batches * 2
    first = [tuple(r) for r in rows_a[:epoch]]
    assert sorted(first) == sorted(tuple(r) for mb in a.micro_batches for r in mb)
    assert [tuple(r) for r in rows_a[epoch:2 * epoch]] != first, "a new order each epoch"
    other = SFTData(cfg.replace(**{"train.seed": 1}))
    assert [other.row(1, i) for i in range(8)] != rows_a[:8]
    # bucketing: the rows of a micro batch have similar lengths (sorted within chunks)
    lengths = [ex.positions for ex in a.examples]
    spread = [abs(lengths[mb[0][0]] - lengths[mb[1][0]]) for mb in a.micro_batches]
    assert max(spread) < max(lengths) - min(lengths)


# ---------------------------------------------------------------------------------------------- packed attention
@pytest.mark.parametrize("attention,extra", [
    ("sdpa", ()), ("eager", ()), ("flex", ()),
    ("eager", ("model.sliding_window=5", "model.attention_sinks=true")),
    ("flex", ("model.sliding_window=5", "model.attention_sinks=true")),
    ("eager", ("model.attention=mla", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
               "model.qk_rope_head_dim=8", "model.v_head_dim=16")),
], ids=["sdpa", "eager", "flex", "eager-window-sinks", "flex-window-sinks", "eager-mla"])
def test_packed_logits_equal_each_example_alone(tok_dir, tmp_path, attention, extra):
    data = write_jsonl(tmp_path / "d.jsonl", arithmetic(12))
    cfg = sft_config(data, tok_dir, f"backend.attention={attention}", "train.seq_len=128",
                     "model.moe.capacity_factor=0", *extra)
    d = SFTData(cfg)
    torch.manual_seed(0)
    model = MoETransformer(cfg.model, cfg.backend)
    model.init_weights(seed=3)
    with torch.no_grad():
        sinks = [m.sinks for m in model.modules() if getattr(m, "sinks", None) is not None]
        for s in sinks:
            s.normal_()  # learned sinks, not zeros
        b = d.micro_batch(1, 0, 2)
        set_documents(model, b.documents_BL)
        packed_BLV = model(b.inputs_BL, b.positions_BL)
        set_documents(model, None)
        for r, row in enumerate([d.row(1, 0), d.row(1, 1)]):
            assert len(row) > 1
            at = 0
            for i in row:
                ex = d.examples[i]
                alone_LV = model(torch.from_numpy(ex.ids_N[:-1])[None])[0]
                n = ex.positions
                err = (packed_BLV[r, at:at + n] - alone_LV).abs().max().item()
                assert err < 1e-5 * alone_LV.abs().max().item(), (r, i, err)
                at += n


def test_unmasked_packing_would_differ(tok_dir, tmp_path):
    """The check above can fail: without the document mask the second example of a row sees the first."""
    data = write_jsonl(tmp_path / "d.jsonl", arithmetic(12))
    cfg = sft_config(data, tok_dir, "train.seq_len=128", "model.moe.capacity_factor=0")
    d = SFTData(cfg)
    model = MoETransformer(cfg.model, cfg.backend)
    model.init_weights(seed=3)
    with torch.no_grad():
        b = d.micro_batch(1, 0, 1)
        row = d.row(1, 0)
        first = d.examples[row[0]].positions
        logits = model(b.inputs_BL, b.positions_BL)[0, first:first + d.examples[row[1]].positions]
        alone = model(torch.from_numpy(d.examples[row[1]].ids_N[:-1])[None])[0]
    assert (logits - alone).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------- training
def step_losses(run_dir):
    return [e["loss"] for e in read_events(Path(run_dir) / "metrics.jsonl") if e["event"] == "step"]


@pytest.fixture
def one_thread():
    """One CPU thread, like each launched rank: on a busy machine OpenMP's spinning threads slow small kernels."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_sft_run_lowers_the_response_loss_and_resumes_exactly(tok_dir, tmp_path, one_thread):
    data = write_jsonl(tmp_path / "d.jsonl", arithmetic(24))
    cfg = sft_config(data, tok_dir, "train.steps=8", "train.checkpoint_every=4", "train.warmup_steps=1")
    Trainer(cfg, tmp_path / "full", env=DistEnv()).run()
    losses = step_losses(tmp_path / "full")
    assert losses[-1] < losses[0] - 1.0, losses
    # padding is no input to the routing statistics: each MoE layer routes top_k of every real token
    d = SFTData(cfg)
    real = [sum(int(d.micro_batch(s, f, 2).valid_BL.sum()) for f in range(0, 8, 2)) for s in (1, 2)]
    steps = [e for e in read_events(tmp_path / "full" / "metrics.jsonl") if e["event"] == "step"][:2]
    for n, e in zip(real, steps):
        assert n < 8 * 64, "the batch has padding"
        assert [sum(layer) for layer in e["routing"]["routed_per_expert"]] == [n * cfg.model.moe.top_k]

    class StopsAfterStep4(Trainer):
        def after_step(self, step, last):
            super().after_step(step, last)
            self.stop_requested = self.stop_requested or step == 4

    assert StopsAfterStep4(cfg, tmp_path / "resumed", env=DistEnv()).run()["status"] == "PREEMPTED"
    Trainer(cfg, tmp_path / "resumed", env=DistEnv()).run()
    assert step_losses(tmp_path / "resumed") == pytest.approx(losses, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2], ids=["fsdp2", "fsdp2-ep2"])
def test_two_ranks_reproduce_one_process(tok_dir, tmp_path, one_thread, ep):
    """Each rank trains its micro batches of the same global batch: the losses and routing counts of one."""
    data = write_jsonl(tmp_path / "d.jsonl", arithmetic(24))
    cfg = sft_config(data, tok_dir, "train.steps=3", "train.warmup_steps=1", "train.save_checkpoints=false")
    Trainer(cfg, tmp_path / "one", env=DistEnv()).run()
    run_local_processes(cfg.replace(**{"parallel.ep": ep}), tmp_path / "two", 2,
                        env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    events = read_events(tmp_path / "two" / "metrics.jsonl")
    assert (events[0]["env"]["layout"]["fsdp"], events[0]["env"]["layout"]["ep"]) == (2, ep)
    assert step_losses(tmp_path / "two") == pytest.approx(step_losses(tmp_path / "one"), rel=1e-5)
    routed = [[e["routing"]["routed_per_expert"] for e in read_events(Path(d) / "metrics.jsonl")
               if e["event"] == "step"] for d in (tmp_path / "one", tmp_path / "two")]
    assert routed[0] == routed[1]


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("lines,message", [
    (['{"prompt": "a", "response": "b"}', '{"prompt": "a", '], "line 2 is not JSON"),
    (['{"messages": [{"role": "user", "content": "hi"}]}'], "line 1: no assistant message"),
    (['{"prompt": "hi"}'], "line 1: no response"),
    (['{"prompt": "hi", "response": ""}'], "line 1: no response"),
    (['[1, 2]'], "line 1: a JSON list, not a record"),
    (['{"text": "hi"}'], "line 1: keys ['text']"),
    (['{"messages": [{"role": "user"}]}'], "line 1: 'messages' must be a list"),
    (['{"prompt": "hi", "response": "' + "the cat sat " * 20 + '"}'], "longer than train.seq_len + 1 = 65"),
])
def test_bad_records_are_refused_with_their_line(tok_dir, tmp_path, lines, message):
    data = write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(ConfigError, match="data.path=") as e:
        check_data(sft_config(data, tok_dir))
    assert message in str(e.value)


def test_missing_file_and_missing_chat_template_are_refused(tok_dir, tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        check_data(sft_config(tmp_path / "none.jsonl", tok_dir))
    data = write_jsonl(tmp_path / "d.jsonl", arithmetic(2))
    bare = make_tokenizer(tmp_path / "bare", template=None)
    with pytest.raises(ConfigError, match="data.tokenizer=.*has no chat template.*data.chat_template"):
        check_data(sft_config(data, bare))
    (tmp_path / "chatml.jinja").write_text(CHATML)
    cfg = sft_config(data, bare, f"data.chat_template={tmp_path / 'chatml.jinja'}")
    assert load_chat_tokenizer(cfg).chat_template == CHATML
    check_data(cfg)
    with pytest.raises(ConfigError, match="data.tokenizer=.*not a folder"):
        check_data(sft_config(data, tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="do not fit model.vocab_size=256"):
        check_data(sft_config(data, tok_dir, "model.vocab_size=256"))


@pytest.mark.parametrize("override,field", [
    ("data.tokenizer=bytes", "data.tokenizer='bytes'"), ("parallel.pp=2", "parallel.pp=2"),
    ("parallel.cp=2", "parallel.cp=2"), ("train.eval_every=2", "train.eval_every=2"),
    ("backend.attention=te", "data.sft_packing=True"),
])
def test_unsupported_settings_are_refused_when_the_config_is_built(tok_dir, tmp_path, override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        sft_config(tmp_path / "d.jsonl", tok_dir, override)
    with pytest.raises(ConfigError, match="data.chat_template"):
        load_config("tiny", ["data.chat_template=x.jinja"])


def test_submit_refuses_a_bad_record_before_any_rank_starts(tok_dir, tmp_path):
    from moelab import Session

    data = write_jsonl(tmp_path / "d.jsonl", arithmetic(3) + ['{"messages": [{"role": "user", "content": "x"}]}'])
    with pytest.raises(ConfigError, match="line 4: no assistant message"):
        Session(sft_config(data, tok_dir)).submit("local", nproc=2, folder=tmp_path / "run")
    assert not (tmp_path / "run").exists()
