"""The one exception type that the CLI turns into a clear message instead of a traceback."""


class NblError(Exception):
    """Bad input or a missing prerequisite, described so that the user can fix it."""
