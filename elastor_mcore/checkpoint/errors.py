"""The checkpoint package's error, in a leaf module: ``format`` and ``location`` both
raise it, and ``format`` imports ``location``."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, corrupted, or does not fit the run."""
