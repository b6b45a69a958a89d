"""Paths a person gives (data files, tokenizers, templates, run and output folders) checked for what they are
before anything reads, writes or submits: a FIFO would block the reader, /dev/zero would read without end, a
file where a folder is expected (or the reverse) fails deep in a rank. The ConfigError names the field, the
value, what is there and the fix, as the config file's own reader does (moelab.config.yaml_io.read_text, which
also bounds a file read whole).

    check_path("data.path", "/dev/zero", "file", "give a flat file of uint16 token ids")
    # ConfigError: data.path='/dev/zero': a character device, not a regular file; give a flat file of ...
    check_path("data.path", "nowhere", "file", "give ...")   # ConfigError: data.path='nowhere': no such file; ...
    check_path("folder", "runs/a", "folder to write", "give a new folder, or one of yours")   # Path('runs/a')
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from moelab.config.rules import ConfigError, shown

WANTS = ("file", "folder", "file or folder", "folder to write")  # "folder to write": a folder, or nothing yet
# the fix for a run, sweep or fork folder that is a file, a FIFO or a device
RUN_FOLDER_FIX = "give a new folder, or a folder of yours (moelab run --out, Session.submit(folder=...))"


def path_kind(path: "str | Path") -> str:
    """What is at `path` (links followed), in words: "nothing", "a regular file", "a folder", "a FIFO (named
    pipe)", "a character device", "a block device", "a socket", "a path under a file", or why it cannot be
    looked at."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "nothing"
    except NotADirectoryError:
        return "a path under a file"
    except (OSError, ValueError) as e:  # a NUL byte, a name too long, no permission
        return f"a path that cannot be looked at ({getattr(e, 'strerror', None) or e})"
    for test, words in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"),
                        (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a file or folder"


def check_path(field: str, value: "str | Path", want: str, fix: str) -> Path:
    """`value` of `field` as a Path when it is what `want` (one of WANTS) asks for; else a ConfigError naming the
    field, the value, what is there and `fix`."""
    kind = path_kind(value)
    ok = {"file": ("a regular file",), "folder": ("a folder",), "file or folder": ("a regular file", "a folder"),
          "folder to write": ("a folder", "nothing")}[want]
    if kind in ok:
        return Path(value)
    if kind == "nothing":
        raise ConfigError(f"{field}={shown(str(value))}: no such {'file' if want == 'file' else want}; {fix}")
    expected = {"file": "a regular file", "file or folder": "a file or folder"}.get(want, "a folder")
    raise ConfigError(f"{field}={shown(str(value))}: {kind}, not {expected}; {fix}")
