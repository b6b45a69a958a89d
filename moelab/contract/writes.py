"""Every write to a run folder goes through here: a file replaced atomically, a line appended, a file written
durably. A write that fails because the disk is full or the folder is read-only or not ours (ENOSPC, EDQUOT,
EROFS, EACCES, EPERM) raises FolderWriteError, which names the cause, the path, the bytes it needed and the
bytes free, and leaves no temporary file behind; the files that were there stay as they were, so the run
stays resumable once the disk is writable again. Readers never need to write: what they learn may be
recorded with `write_if_possible`, which skips silently where the folder cannot be written.

    write_atomic("runs/a/run.json", b"{}")       # temp file + os.replace, the temp file removed on failure
    append_line("runs/a/metrics.jsonl", b"{...}\\n")
    try: ...
    except FolderWriteError as e: e.cause, e.path, e.need, e.free   # "disk full", ..., 81, 0
    with writing("runs/a/.lock"): os.open(...)   # any other write (the lock): the same error
    folder_cause(exc)                            # the OSError a person must fix in an exception's chain, or None

Standard library only (the contract layer).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Callable

# the errors that say "this folder cannot be written now" (a person must free space or fix permissions)
CAUSES = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only file system",
          errno.EACCES: "permission denied", errno.EPERM: "operation not permitted"}


class FolderWriteError(OSError):
    """A write to a run folder failed for a reason a person must fix: `cause` ("disk full", "read-only file
    system", "permission denied", ...), `path`, `need` (bytes the write needed; None: not known) and `free`
    (bytes free there). `left`: what the failed write left behind; `then`: what to do once the folder can be
    written (default: resume the run in the folder of `path`).

        FolderWriteError(errno.ENOSPC, "runs/a/metrics.jsonl", need=812, free=0)
        # runs/a/metrics.jsonl: disk full: writing 812 bytes, 0 bytes free there; the file was left as it was ...
    """

    def __init__(self, err: int, path: "str | Path", need: "int | None", free: "int | None" = None,
                 left: str = "the file was left as it was (no temporary file)", then: "str | None" = None):
        self.cause, self.path, self.need = CAUSES.get(err, os.strerror(err)), Path(path), need
        self.free = free_bytes(self.path) if free is None else free
        fix = "free space" if err in (errno.ENOSPC, errno.EDQUOT) else "make the folder writable"
        then = then or f"resume the run (`moelab resume {self.path.parent}`)"
        size = "" if need is None else f"writing {need:,} bytes, "
        super().__init__(err, f"{self.path}: {self.cause}: {size}{self.free:,} bytes free there; {left}. "
                              f"{fix.capitalize()}, then {then}")

    def __str__(self) -> str:
        return self.strerror


def free_bytes(path: "str | Path") -> int:
    """Free bytes (for this user) on the file system of `path`, or of its nearest existing parent; 0 when it
    cannot be asked."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def _fail(e: OSError, path: "str | Path", need: "int | None", **kw):
    """FolderWriteError for the errors a person must fix, else the OSError itself."""
    if e.errno in CAUSES and not isinstance(e, FolderWriteError):
        raise FolderWriteError(e.errno, path, need, **kw) from e
    raise e


@contextlib.contextmanager
def writing(path: "str | Path", need: "int | None" = None, **kw):
    """Writes of the block (mkdir, open, write) whose failures a person must fix raise FolderWriteError naming
    `path` (`kw`: its `left` and `then`); other errors pass unchanged."""
    try:
        yield
    except OSError as e:
        _fail(e, path, need, **kw)


def folder_cause(exc: "BaseException | None", errnos=tuple(CAUSES)) -> "OSError | None":
    """The first OSError with an errno of `errnos` (default: those a person must fix) anywhere in `exc`'s chain:
    causes, contexts, and the per-rank `failures` of torch.distributed.checkpoint's CheckpointException (where
    torch's zip writer hides ENOSPC under a RuntimeError "unexpected pos ..."); None when there is none."""
    seen, stack = set(), [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in errnos:
            return e
        stack += [e.__cause__, e.__context__]
        stack += [pair[0] if isinstance(pair, tuple) else pair for pair in getattr(e, "failures", {}).values()]
    return None


def write_atomic(path: "str | Path", data: "str | bytes", durable: bool = False) -> None:
    """Replace `path` with `data` atomically (another process may be reading it): a temporary file next to it,
    then os.replace; fsync'ed first when `durable`. On failure the temporary file is removed and `path` is as
    it was."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        _fail(e, path, len(data))


def write_durably(path: "str | Path", data: "str | bytes") -> None:
    """Write a whole new file and fsync it before returning (callers then rename it into place); removed again
    when the write fails."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if path.is_file() and not path.is_symlink():  # our half-written file; never a device (/dev/full)
            try:
                path.unlink()
            except OSError:
                pass
        _fail(e, path, len(data))


def append_line(path: "str | Path", line: bytes) -> None:
    """Append one whole line with a single O_APPEND write (lines of several processes do not interleave). A
    write cut short by a full disk is taken back (the file is truncated to where it was), so the stream never
    holds half a line because of it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        _fail(e, path, len(line))
    try:
        before = os.fstat(fd).st_size
        try:
            written = os.write(fd, line)
        except OSError as e:
            _take_back(fd, before)
            _fail(e, path, len(line))
        if written < len(line):  # the disk filled up mid-line
            _take_back(fd, before)
            raise FolderWriteError(errno.ENOSPC, path, len(line))
    finally:
        os.close(fd)


def _take_back(fd: int, size: int) -> None:
    try:
        if os.fstat(fd).st_size > size:
            os.ftruncate(fd, size)
    except OSError:
        pass


def write_if_possible(write: Callable[[], object]) -> bool:
    """Run a reader's optional write (e.g. recording a status it learnt in run.json); False, and nothing
    raised, when the folder cannot be written (read-only, not ours, full)."""
    try:
        write()
        return True
    except OSError as e:
        if e.errno in CAUSES:
            return False
        raise
