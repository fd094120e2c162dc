"""The training loop's per-step callbacks on every active rank.

The loop (``train.train``) calls them and knows nothing of who listens: under
``elastor launch`` the rank's entry point passes the supervisor's implementation
(``elastic.rank.hooks.ElasticHooks``: heartbeats, events, injected failures).
"""

from __future__ import annotations


class StepHooks:
    """Called on every active rank; steps are 1-based, as printed. The base class does
    nothing."""

    def ready(self, start_step: int, load_s: float) -> None:
        """Set up and, after ``load_s`` seconds of loading, resumed at ``start_step``."""

    def step_start(self, step: int) -> None:
        """Step ``step`` is about to begin."""

    def step_end(self, step: int) -> None:
        """Step ``step`` is done (and its save, if one was due, started)."""
