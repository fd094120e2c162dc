"""The error type of the data package, kept apart so every module can raise it."""


class DataError(ValueError):
    """Bad training data or data flags; the message names the file, line or flag and the fix."""
