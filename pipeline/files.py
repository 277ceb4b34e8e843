"""Atomic file writes: a reader (or a run that resumes after a kill) never sees half a file.

Each writer writes ``<name>.tmp`` beside the target, flushes it to disk, then renames it over the
target, which is atomic on POSIX file systems.

Example::

    write_json(folder / "result.json", {"auc": 0.79})
    with atomic_open(folder / "model.pt") as f:
        torch.save(state, f)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.errors import UserError

# A write that fails with less free space than this left on its disk failed for want of space (torch.save
# says only "unexpected pos").
_FULL_BYTES = 1 << 20


def tmp_path(path: str | Path) -> Path:
    """The temporary name a write to ``path`` goes through (``<name>.tmp``, in the same folder)."""
    path = Path(path)
    return path.with_name(path.name + ".tmp")


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb") -> Iterator[Any]:
    """A file object for ``path`` that appears there, whole, only when the block ends without an error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    try:
        with full_disk_named(path), open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def full_disk_named(path: str | Path) -> Iterator[None]:
    """Within the block, an error raised while the disk of ``path`` (a file, or a folder being written) is all but
    full is that disk's ``ENOSPC``, naming ``path``: torch.save says only "unexpected pos", numpy's save "N requested
    and M written"."""
    path = Path(path)
    try:
        yield
    except Exception as err:
        disk = next((p for p in (path, *path.parents) if p.is_dir()), path.parent)  # the nearest folder that exists
        if getattr(err, "errno", None) == errno.ENOSPC or _full(disk):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from err
        raise


def _full(folder: Path) -> bool:
    try:
        stats = os.statvfs(folder)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < _FULL_BYTES


def remove_tmp_files(folder: str | Path, recursive: bool = False) -> list[Path]:
    """Delete the ``*.tmp`` files that killed writes left in ``folder`` (and below it with ``recursive``).

    Call it only while nothing writes there. Returns the files removed.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in (folder.rglob("*.tmp") if recursive else folder.glob("*.tmp")) if p.is_file()]
    for p in found:
        p.unlink(missing_ok=True)
    return found


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_open(path, "w") as f:
        f.write(text)


def write_json(path: str | Path, value: Any) -> None:
    """Write ``value`` as indented JSON atomically (values JSON cannot hold are written as strings)."""
    write_text(path, json.dumps(value, indent=2, default=str) + "\n")


class DamagedFileError(UserError):
    """A file the pipeline wrote that no longer reads as it was written (cut short, or changed by hand)."""


def read_json(path: str | Path, remedy: str) -> Any:
    """The JSON value in ``path``; one that is not whole JSON is a :class:`DamagedFileError` naming the file and
    ``remedy``, what makes it again."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DamagedFileError(f"{path} is not whole JSON ({err}): it was cut short or changed by hand; "
                               f"{remedy}") from err


class FileLock:
    """A ``flock`` on ``path`` (created) while this process holds it: exclusive, or ``shared`` with other shared
    holders. Another holder that excludes it is a UserError saying ``busy``; with ``wait`` instead, that line is
    printed and the lock waited for. On a filesystem without locks it says so in a line and locks nothing. A context
    manager; the lock ends with the process too."""

    def __init__(self, path: Path, busy: str, shared: bool = False, wait: str | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.busy = path, busy
        self._file = open(path, "a")  # held until release
        self._locks = True
        self._take(shared, wait)

    def _take(self, shared: bool, wait: str | None) -> bool:
        """Lock (or relock) the file; whether this process waited for it. Where locks are not supported, a line."""
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        try:
            fcntl.flock(self._file, mode | fcntl.LOCK_NB)
            return False
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                print(f"cannot lock {self.path} ({err.strerror}): {self.busy} would not be refused", flush=True)
                self._locks = False
                return False
            if wait is None:
                self.release()
                raise UserError(self.busy) from None
        print(wait, flush=True)
        fcntl.flock(self._file, mode)
        return True

    def change(self, shared: bool, wait: str) -> bool:
        """Hold the lock shared or exclusive from now on, waiting (``wait`` printed) while another holder excludes
        it; whether it waited. The change is not atomic: another process may take the lock between the two."""
        return self._locks and self._take(shared, wait)

    def release(self) -> None:
        self._file.close()

    def __enter__(self) -> FileLock:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
