"""Fixtures of the gallery tests."""
import shutil

import pytest

from moelab.gallery import default_root


@pytest.fixture
def gallery(tmp_path):
    """A copy of the gallery's entries with an empty results folder."""
    root = tmp_path / "gallery"
    shutil.copytree(default_root() / "entries", root / "entries")
    (root / "results").mkdir()
    return root
