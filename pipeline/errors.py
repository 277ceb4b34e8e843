"""Errors a user can act on: the CLI prints them plainly, without a traceback."""

import math


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
