"""Kept for old imports and `python -m moelab.compare`: the comparison lives in moelab.live.compare, and its
command is `moelab compare FOLDERS... [--out FIG.png]`."""
from moelab.live.compare import Comparison, compare  # noqa: F401

if __name__ == "__main__":
    import sys

    from moelab.cli import main

    raise SystemExit(main(["compare", *sys.argv[1:]]))
