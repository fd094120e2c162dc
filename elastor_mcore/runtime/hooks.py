"""The training loop's callbacks on every active rank: per step, and for a recovery
in place.

The loop (``train.train``) calls them and knows nothing of who listens: under
``elastor launch`` the rank's entry point passes the supervisor's implementations
(``elastic.rank.hooks.ElasticHooks``: heartbeats, events, injected failures;
``elastic.rank.inplace.InPlaceRecovery``: the survivors' agreement on a new layout).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastor_mcore.parallel.layout import Layout


class StepHooks:
    """Called on every active rank; steps are 1-based, as printed. The base class does
    nothing."""

    def load_failed(self, error: BaseException) -> None:
        """The checkpoint to resume from could not be read (the loop then raises it)."""

    def ready(self, start_step: int, load_s: float) -> None:
        """Set up and, after ``load_s`` seconds of loading, resumed at ``start_step``."""

    def step_start(self, step: int) -> None:
        """Step ``step`` is about to begin."""

    def busy(self, what: str) -> None:
        """Step work that is not a training step begins (``"save"``): the hang timeout
        allows it start-up time until ``step_end``."""

    def step_end(self, step: int) -> None:
        """Step ``step`` is done (and its save, if one was due, started)."""

    def recovering(self, step: int) -> None:
        """Step ``step`` failed; a recovery in place begins."""


@dataclass(frozen=True)
class Regroup:
    """Where the survivors of a failure continue: a layout on a new world of exactly its
    ranks, this process already a member (``torch.distributed`` initialised again)."""

    layout: Layout
    """On the new world's ranks (0..n-1)."""
    rank_slots: tuple[int, ...]
    """The physical slot of each new rank."""
    epoch: int
    """Counts the recoveries in place of this job (1 for the first)."""


class Recovery:
    """How the loop recovers in place when a step fails because a peer is gone: the
    survivors leave the broken groups, agree on who is left and on a layout for them
    (``regroup``), then the loop rebuilds its stage and restores the state from the
    copies in memory (``runtime.reshard``) and reports it (``resumed``). The base class
    does not recover: ``regroup`` raises the error."""

    def regroup(self, error: BaseException, step: int) -> Regroup | None:
        """After ``error`` in step ``step`` (1-based): the new layout, or None when it
        leaves this rank out (the rank then ends). Raise to give up (the supervisor
        then relaunches from the durable checkpoint)."""
        raise error

    def resumed(self, regroup: Regroup, step: int, phases: dict[str, float],
                received_bytes: int, durable_cells: int) -> None:
        """The state of ``step`` is restored under ``regroup.layout``, after ``phases``
        (seconds: ``build`` the stage, ``restore`` the state)."""
