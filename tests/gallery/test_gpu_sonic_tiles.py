"""gallery/scripts/gpu_sonic_tiles.py's candidates and choice: the tiles QuACK allows per GEMM (a gathered operand
needs clusters of one along N and the static scheduler on sm90, a gated epilogue tiles N by multiples of 32), and a
tile replaces QuACK's default only when faster by the margin."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gallery" / "scripts"))

import gpu_sonic_tiles as sweep  # noqa: E402
from moelab.backends.sonic import GEMMS, TILE_FIELDS  # noqa: E402


def test_every_gemm_is_swept_from_quacks_default_within_quacks_rules():
    assert set(sweep.GATHERED) | set(sweep.GATED) | {"down", "up_dx"} == set(GEMMS)
    assert sweep.DEFAULT == (128, 192, True, 2, 1, False) and len(sweep.DEFAULT) == len(TILE_FIELDS)
    for gemm in GEMMS:
        tiles = sweep.candidates(gemm)
        assert tiles[0] == sweep.DEFAULT and len(set(tiles)) == len(tiles) > 5
        for tile_m, tile_n, pingpong, cluster_m, cluster_n, dynamic in tiles:
            if gemm in sweep.GATHERED:
                assert cluster_n == 1 and not dynamic
            if gemm in sweep.GATED:
                assert tile_n % 32 == 0
    assert len(sweep.candidates("down")) == len(sweep.CANDIDATES)  # nothing gathered or gated: every tile


def test_a_tile_is_chosen_only_when_it_beats_the_default_by_the_margin():
    other = (256, 128, False, 2, 1, False)
    assert sweep.choose({sweep.DEFAULT: 1.0, other: 0.97}, 0.02) == other
    assert sweep.choose({sweep.DEFAULT: 1.0, other: 0.99}, 0.02) is None
    assert sweep.choose({sweep.DEFAULT: 1.0, other: float("inf")}, 0.02) is None  # failed or wrong: never chosen
    assert sweep.choose({other: 0.5}, 0.02) is None  # without the default's time there is nothing to beat


def test_the_rows_sweep_frees_the_gathered_gemms_and_names_moelabs_sets():
    # gallery/scripts/gpu_sonic_rows.py: a GEMM reading rows copied once may take any tile (its gathered form only
    # the ones above); its layer variants are the sets moelab.backends.sonic.rows_once accepts
    import gpu_sonic_rows as rows
    from moelab.backends.sonic import ROWS_ONCE

    for gemm in rows.ROW_GEMMS:
        assert gemm in sweep.GATHERED
        assert set(sweep.candidates(gemm)) < set(rows.row_candidates(gemm))
    assert rows.row_candidates("up_dw") == sweep.CANDIDATES
    assert all(t[1] % 32 == 0 for t in rows.row_candidates("down_dact"))
    sets = {frozenset(filter(None, names.split(","))) for names in rows.ROW_SETS.values()}
    assert ROWS_ONCE in sets and all(s <= set(rows.ROW_GEMMS) for s in sets)
