"""data.kind=hf: a Hugging Face dataset saved to disk (no test downloads anything) becomes the same token
stream as its texts would; splits and fields are checked."""
import numpy as np
import pytest

from moelab.config import ConfigError, load_config
from moelab.data.batches import TextData, check_data

datasets = pytest.importorskip("datasets")

TEXTS = [f"document number {i}: " + "mixture of experts " * (i % 5 + 1) for i in range(30)]


def _cfg(tmp_path, path, *overrides):
    return load_config("tiny", ["data.kind=hf", f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}",
                                "train.seq_len=16"] + list(overrides))


def test_a_saved_dataset_is_tokenised_like_its_texts(tmp_path):
    datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(30))}).save_to_disk(tmp_path / "ds")
    data = TextData(_cfg(tmp_path, tmp_path / "ds"), progress=False)
    assert bytes(np.asarray(data.tokens, dtype=np.uint8)) == b"".join(t.encode() + b"\0" for t in TEXTS)


def test_a_saved_dataset_dict_split_field_and_validation(tmp_path):
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": TEXTS}),
                               "test": datasets.Dataset.from_dict({"body": TEXTS[:3]})})
    ds.save_to_disk(tmp_path / "dd")
    cfg = _cfg(tmp_path, tmp_path / "dd", "data.text_field=body", "data.hf_split=test")
    assert bytes(np.asarray(TextData(cfg, progress=False).tokens, dtype=np.uint8)).split(b"\0")[:3] == \
        [t.encode() for t in TEXTS[:3]]
    cfg = _cfg(tmp_path, tmp_path / "dd", "data.text_field=body", "data.val_fraction=0.2", "train.eval_every=2")
    check_data(cfg, progress=False)
    val = bytes(np.asarray(TextData(cfg, "val", progress=False).tokens, dtype=np.uint8)).split(b"\0")
    assert 1 <= len([v for v in val if v]) < 30


@pytest.mark.parametrize("overrides, match", [
    (["data.text_field=content"], "data.text_field='content': .* has no such column; its columns: text"),
    (["data.hf_split=validation"], None),  # a single Dataset has no splits: hf_split is unused
])
def test_bad_fields_of_a_saved_dataset(tmp_path, overrides, match):
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(tmp_path / "ds")
    cfg = _cfg(tmp_path, tmp_path / "ds", *overrides)
    if match is None:
        check_data(cfg, progress=False)
        return
    with pytest.raises(ConfigError, match=match):
        check_data(cfg, progress=False)


def test_a_missing_split_or_dataset_is_a_config_error(tmp_path, monkeypatch):
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS})}).save_to_disk(tmp_path / "dd")
    with pytest.raises(ConfigError, match="data.hf_split='test': .* has the splits train"):
        check_data(_cfg(tmp_path, tmp_path / "dd", "data.hf_split=test"), progress=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # a hub name is looked up only where the machine is online
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="data.path='no-such-user/no-such-dataset': cannot load the dataset"):
        check_data(_cfg(tmp_path, "no-such-user/no-such-dataset"), progress=False)
