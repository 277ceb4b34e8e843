"""Errors a user can act on: the CLI prints them plainly, without a traceback."""


class UserError(Exception):
    """Base class: something about the input or the settings that the user can fix."""


class BadInputError(UserError, ValueError):
    """Input data that is missing, empty, malformed or does not match what was declared.

    The message says what was expected and what was found.
    """
