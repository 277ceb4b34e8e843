"""Errors a user can act on: the CLI prints them plainly, without a traceback."""

import errno
import math
import re


class UserError(Exception):
    """Base class: something about the input or the settings that the user can fix."""


class BadInputError(UserError, ValueError):
    """Input data that is missing, empty, malformed or does not match what was declared.

    The message says what was expected and what was found.
    """


class SettingError(UserError, ValueError):
    """A setting's value outside what it allows: the message names the setting and its range."""


def check_range(name: str, value: object, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False) -> None:
    """Raise :class:`SettingError` naming the setting and its allowed range unless ``value`` is a finite number in it.

    ``check_range("train.lr", lr, 0, low_open=True)`` allows ``lr > 0``; nan and infinities are
    never allowed. The settings' ``__post_init__`` checks call it for every number they hold.
    """
    if low is not None and high is not None:
        allowed = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    elif low is not None:
        allowed = f"{'>' if low_open else '>='} {low}"
    else:
        allowed = f"{'<' if high_open else '<='} {high}"
    kind = "an integer" if isinstance(value, int) else "a finite number"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = number and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise SettingError(f"{name}: expected {kind} {allowed}, got {value!r}")


_ADVICE = {
    errno.ENOSPC: "free space on that disk, or choose another workdir",
    errno.EDQUOT: "free space within your quota, or choose another workdir",
    errno.EROFS: "choose a writable workdir",
    errno.EACCES: "give this user access to it, or choose another workdir",
    errno.EPERM: "give this user access to it, or choose another workdir",
    errno.EISDIR: "a folder stands where a file is written: remove it",
    errno.ENOTDIR: "a file stands where a folder is expected: remove it",
    errno.EMFILE: "raise the limit of open files (ulimit -n)",
    errno.ENFILE: "close other programs' files, or raise the system's limit",
}


def environment_problem(err: BaseException, where: str | None = None) -> str | None:
    """What the machine refused, for an error whose cause (or its cause...) is an operating system error a user
    fixes outside the pipeline (a full or read-only disk, a permission, a folder where a file goes): the file (or,
    where the error names none, as Arrow's do not, ``where``), what failed and what to do. None for any other
    error."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        code = getattr(err, "errno", None) if isinstance(err, OSError) else None
        if code is None and isinstance(err, OSError):  # Arrow's: "... Detail: [errno 28] No space left on device"
            found = re.search(r"\[errno (\d+)\]", str(err))
            code = int(found.group(1)) if found else None
        if code in _ADVICE:
            named = getattr(err, "filename", None) or where
            what = err.strerror if getattr(err, "strerror", None) else str(err)
            return f"{named + ': ' if named else ''}{what}: {_ADVICE[code]}"
        err = err.__cause__ or err.__context__
    return None
