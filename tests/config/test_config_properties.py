"""Property-based tests (hypothesis) of everything a user can feed the config loader: dicts, YAML files and
--set overrides. Every input either builds a valid Config or is rejected with a ConfigError; never another
exception, never executed code. Where one field is wrong, the message names that field.

Each test prints how many inputs it tried (`pytest -s`); docs/reliability.md's figures come from there.
"""
from __future__ import annotations

import dataclasses
import math
import typing

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from moelab.config import Config, ConfigError, load_config, parse_override
from moelab.layout.dims import check_layout

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _leaves(cls=Config, prefix: str = "") -> dict[str, typing.Any]:
    """Every settable field of the config, by dotted name, with its type."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(_leaves(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = tp
    return out


LEAVES = _leaves()
SECTIONS = sorted({name.rsplit(".", 1)[0] for name in LEAVES if "." in name})
INT_FIELDS = sorted(n for n, tp in LEAVES.items() if tp is int)
FLOAT_FIELDS = sorted(n for n, tp in LEAVES.items() if tp is float)
# fields where 0 is not a valid value (1 is the smallest)
MUST_BE_POSITIVE = ["model.vocab_size", "model.hidden_size", "model.num_layers", "model.num_heads",
                    "model.num_kv_heads", "model.head_dim", "model.moe.num_experts", "model.moe.top_k",
                    "model.moe.expert_ffn_size", "model.moe.num_groups", "model.moe.topk_groups", "train.steps",
                    "train.global_batch_size", "train.micro_batch_size", "train.seq_len", "train.keep_checkpoints",
                    "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep", "parallel.vp", "parallel.fsdp"]
# float fields with a documented range: (a value outside it, a value inside it)
FLOAT_RANGES = {"train.lr": (-1e-4, 0.0), "train.beta1": (1.0, 0.5), "train.beta2": (-0.1, 0.99),
                "train.min_lr_ratio": (1.5, 0.5), "train.grad_clip": (-1.0, 0.0), "train.weight_decay": (-0.1, 0.1),
                "train.collective_timeout_s": (0.0, 30.0), "model.rope_theta": (-1.0, 5e5),
                "model.norm_eps": (0.0, 1e-5), "model.moe.route_scale": (0.0, 2.5),
                "model.moe.capacity_factor": (-1.0, 1.5), "model.moe.aux_loss_coeff": (-1e-3, 1e-3),
                "data.noise": (1.5, 0.2)}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12))
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                    max_leaves=8)


def _typed(tp):
    """Values of roughly the right type, in and around the valid range (the interesting edge)."""
    if typing.get_origin(tp) is typing.Literal:
        return st.one_of(st.sampled_from(typing.get_args(tp)), st.text(max_size=8))
    return {int: st.integers(-3, 70), float: st.floats(-2.0, 70.0), bool: st.booleans(),
            str: st.text(max_size=8)}.get(tp, junk)


field_and_value = st.sampled_from(sorted(LEAVES)).flatmap(
    lambda f: st.tuples(st.just(f), st.one_of(_typed(LEAVES[f]), _typed(LEAVES[f]).map(str), junk)))


def _nested(dotted: str, value) -> dict:
    d: dict = {}
    node = d
    *parents, last = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return d


def _names_field(message: str, field: str) -> bool:
    return message.startswith(f"{field}=") or f" {field}=" in message or f"{field}:" in message


def _report(what: str, tried: int, rejected: int) -> None:
    print(f"\nRELIABILITY {what}: {tried} inputs tried, {rejected} rejected with a ConfigError")


# ---------------------------------------------------------------------- any input: Config or ConfigError
def test_any_nested_mapping_is_a_config_or_a_config_error():
    tally = [0, 0]
    section_keys = st.sampled_from(["model", "train", "parallel", "backend", "data", "name", "moe", "junk"])

    @SETTINGS
    @given(st.dictionaries(section_keys, st.one_of(junk, st.dictionaries(
        st.sampled_from(sorted({n.split(".")[-1] for n in LEAVES}) + ["moe", "x"]), junk, max_size=4)),
        max_size=4))
    def check(d):
        tally[0] += 1
        try:
            Config.from_dict(d)
        except ConfigError:
            tally[1] += 1

    check()
    _report("random nested mappings", *tally)
    assert tally[1] > tally[0] // 2


def test_one_wrong_value_is_rejected_naming_that_field_or_accepted_and_typed():
    tally = [0, 0]

    @SETTINGS
    @given(field_and_value)
    def check(field_value):
        field, value = field_value
        tally[0] += 1
        try:
            cfg = Config.from_dict(_nested(field, value))
        except ConfigError as e:
            tally[1] += 1
            wrong_type = not _coercible(LEAVES[field], value)
            if wrong_type:
                assert str(e).startswith(f"{field}="), f"{field}={value!r}: {e}"
            return
        got = cfg
        for part in field.split("."):
            got = getattr(got, part)
        tp = LEAVES[field]
        if tp in (int, float, bool, str):
            assert isinstance(got, tp) and not (tp is int and isinstance(got, bool))
        if tp is float:
            assert math.isfinite(got)

    check()
    _report("one field set to a random value", *tally)


def _coercible(tp, value) -> bool:
    """Could this value be read as the field's type at all (whatever the range)?"""
    if typing.get_origin(tp) is typing.Literal:
        return value in typing.get_args(tp)
    if tp is bool:
        return isinstance(value, bool) or (isinstance(value, str) and value.lower() in
                                          ("true", "false", "1", "0", "yes", "no"))
    if isinstance(value, bool):
        return False
    if tp is int:
        if isinstance(value, int):
            return True
        try:
            return isinstance(value, (float, str)) and float(value).is_integer()
        except (ValueError, OverflowError):
            return False
    if tp is float:
        try:
            return isinstance(value, (int, float, str)) and math.isfinite(float(value))
        except (ValueError, OverflowError):
            return False
    if tp is str:
        return isinstance(value, str)
    return False


# ---------------------------------------------------------------------- targeted classes of bad input
@pytest.mark.parametrize("field", [f for f in INT_FIELDS if f != "train.seed"])  # any seed is a seed
def test_negative_integers_are_rejected_naming_the_field(field):
    with pytest.raises(ConfigError) as e:
        Config.from_dict(_nested(field, -2 if field != "parallel.fsdp" else -3))
    assert str(e.value).startswith(f"{field}="), str(e.value)


@pytest.mark.parametrize("field", MUST_BE_POSITIVE)
def test_zero_is_rejected_where_one_is_the_least(field):
    with pytest.raises(ConfigError) as e:
        Config.from_dict(_nested(field, 0))
    assert _names_field(str(e.value), field), str(e.value)


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), "-inf", "1e999"])
def test_non_finite_numbers_are_rejected(field, value):
    with pytest.raises(ConfigError, match="finite") as e:
        Config.from_dict(_nested(field, value))
    assert str(e.value).startswith(f"{field}=")


@pytest.mark.parametrize("field", sorted(FLOAT_RANGES))
def test_float_ranges(field):
    bad, good = FLOAT_RANGES[field]
    with pytest.raises(ConfigError) as e:
        Config.from_dict(_nested(field, bad))
    assert str(e.value).startswith(f"{field}="), str(e.value)
    Config.from_dict(_nested(field, good))


def test_unknown_keys_and_fields_in_the_wrong_section_are_named():
    tally = [0, 0]
    names = sorted({n.split(".")[-1] for n in LEAVES})

    @SETTINGS
    @given(st.sampled_from(["", *[s + "." for s in SECTIONS]]),
           st.one_of(st.sampled_from(names), st.from_regex(r"[a-z_]{1,12}", fullmatch=True)))
    def check(section, key):
        assume(f"{section}{key}" not in LEAVES and f"{section}{key}" not in SECTIONS)
        tally[0] += 1
        with pytest.raises(ConfigError) as e:
            Config.from_dict(_nested(f"{section}{key}", 1))
        tally[1] += 1
        assert str(e.value).startswith(f"{section}{key}="), str(e.value)

    check()
    _report("unknown keys and misplaced fields", *tally)
    assert tally[0] == tally[1]


def test_overrides_are_a_config_or_a_config_error():
    tally = [0, 0]
    @SETTINGS
    @given(st.one_of(field_and_value.map(lambda fv: (fv[0], str(fv[1]))),
                     st.tuples(st.text(max_size=20), st.text(max_size=20))))
    def check(key_raw):
        key, raw = key_raw
        tally[0] += 1
        try:
            load_config("tiny", [f"{key}={raw}"])
        except ConfigError:
            tally[1] += 1

    check()
    _report("--set KEY=VALUE overrides", *tally)


def test_layouts_for_any_world_size_are_a_layout_or_a_config_error():
    tally = [0, 0]

    @SETTINGS
    @given(st.one_of(st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 64)), st.sampled_from([1, 2, 4, 8, 16]),
           st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([-1, -1, -1, 1, 2, 3, 4, 8]))
    def check(world, ep, pp, cp, fsdp):
        tally[0] += 1
        try:
            cfg = load_config("tiny", {"parallel.ep": ep, "parallel.pp": pp, "parallel.cp": cp,
                                       "parallel.fsdp": fsdp, "model.num_layers": 4})
            layout = check_layout(cfg, world)
        except ConfigError as e:
            tally[1] += 1
            assert "parallel" in str(e) or "train." in str(e), str(e)
            return
        assert layout.tp * layout.pp * layout.cp * layout.fsdp == world

    check()
    _report("layouts against world sizes", *tally)


# ---------------------------------------------------------------------- YAML files
def test_any_yaml_text_is_a_config_or_a_config_error(tmp_path):
    tally = [0, 0]
    path = tmp_path / "c.yaml"

    @SETTINGS
    @given(st.one_of(st.text(max_size=80),
                     junk.map(lambda d: yaml.safe_dump(d)),
                     st.dictionaries(st.sampled_from(["model", "train", "base", "name", "data"]), junk, max_size=3)
                     .map(lambda d: yaml.safe_dump(d))))
    def check(text):
        tally[0] += 1
        path.write_text(text)
        try:
            load_config(path)
        except ConfigError:
            tally[1] += 1

    check()
    _report("YAML documents", *tally)


@pytest.mark.parametrize("doc", ["- 1\n- 2\n", "42\n", "just text\n", "[model, train]\n", "\"quoted\"\n"])
def test_a_yaml_file_that_is_not_a_mapping_is_refused(tmp_path, doc):
    (tmp_path / "c.yaml").write_text(doc)
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(tmp_path / "c.yaml")


PYTHON_TAGS = [
    "!!python/object/apply:os.system ['touch {marker}']",
    "!!python/object/apply:subprocess.call [['touch', '{marker}']]",
    "!!python/object/new:subprocess.Popen [['touch', '{marker}']]",
    "!!python/name:os.system",
    "!!python/module:os",
    "!!python/object:pathlib.Path {{}}",
]


@pytest.mark.parametrize("tag", PYTHON_TAGS)
@pytest.mark.parametrize("where", ["top", "value", "override"])
def test_python_tags_never_execute(tmp_path, tag, where):
    marker = tmp_path / "executed"
    payload = tag.format(marker=marker)
    with pytest.raises(ConfigError):
        if where == "override":
            load_config("tiny", [f"train.steps={payload}"])
        else:
            text = payload if where == "top" else f"train:\n  steps: {payload}\n"
            (tmp_path / "c.yaml").write_text(text + "\n")
            load_config(tmp_path / "c.yaml")
    assert not marker.exists(), "a config executed code"


def test_yaml_base_must_be_a_name_and_must_not_loop(tmp_path):
    (tmp_path / "a.yaml").write_text(f"base: {tmp_path / 'b.yaml'}\n")
    (tmp_path / "b.yaml").write_text(f"base: {tmp_path / 'a.yaml'}\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: [tiny]\n")
    with pytest.raises(ConfigError, match="base="):
        load_config(tmp_path / "c.yaml")


def test_unreadable_files_are_config_errors(tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bin.yaml")
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "dir.yaml")


def test_valid_configs_round_trip_through_yaml(tmp_path):
    tally = [0]

    @SETTINGS
    @given(st.fixed_dictionaries({"train.steps": st.integers(1, 10**6), "train.lr": st.floats(1e-6, 1.0),
                                  "model.moe.num_experts": st.sampled_from([4, 8, 16, 64]),
                                  "model.moe.top_k": st.integers(1, 4), "train.seed": st.integers(0, 10**9),
                                  "name": st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._+=,@-]{0,9}", fullmatch=True)}))
    def check(overrides):
        tally[0] += 1
        cfg = load_config("tiny", overrides)
        from moelab.config import save_config

        save_config(cfg, tmp_path / "rt.yaml")
        assert load_config(tmp_path / "rt.yaml") == cfg

    check()
    print(f"\nRELIABILITY valid configs round-tripped through YAML: {tally[0]}")


def test_parse_override_never_executes():
    key, value = parse_override("train.steps=!!python/object/apply:os.system ['true']")
    assert key == "train.steps" and isinstance(value, str)
    with pytest.raises(ConfigError, match="train.steps=.*expected an integer"):
        load_config("tiny", {key: value})
