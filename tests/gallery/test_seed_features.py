"""gallery/seed-features/seed_features.md is the rendering of its result file, and the result holds what the
issue asked to be measured (so a figure typed into the page, or a result changed without re-rendering, fails)."""
import importlib.util
import json

from moelab.gallery import default_root

PAGE = default_root() / "seed-features" / "seed_features.md"


def _script():
    spec = importlib.util.spec_from_file_location("seed_features", default_root() / "scripts" / "seed_features.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_seed_features_page_is_the_rendering_of_its_result():
    result = json.loads(PAGE.with_suffix(".json").read_text())
    assert PAGE.read_text() == _script().render(result), "run: python gallery/scripts/seed_features.py --render"
    assert result["commit"] and result["command"].startswith("python gallery/scripts/seed_features.py")
    dispatch = result["node_limited_dispatch_ep4"]
    limited = dispatch["node-limited, at most 2 of 4 ranks"]
    assert sum(limited["tokens_by_ranks_reached"][3:]) == 0  # never more than 2 ranks
    flat = dispatch["flat top-4"]
    assert limited["measured_per_step"]["dispatch_token_ranks"] < flat["measured_per_step"]["dispatch_token_ranks"]
    assert result["expert_grad_compression"]["relative_gap_last_50"] < 0.02
