"""Megatron-LM's loop as a launcher watching the job sees it: the replacements that
report the checkpoint load, every iteration (its loss and time), and the saves and
evaluations between iterations to the installation's ``LoopObserver``.

Under ``elastor launch --megatron-lm`` the observer (``elastic.rank.megatron``) turns
these into heartbeats, the recovery timeline's events, the per-iteration metrics and
the failure plan's injections; otherwise it is the base class and nothing happens. The
replacements always call the original: they never change what Megatron-LM computes.
"""

from __future__ import annotations

import time
from typing import Callable

from elastor_mcore.integrations.megatron_lm.installation import Installation


def wrap_load(original: Callable, installation: Installation) -> Callable:
    """``load_checkpoint``, timed (``loaded``); a failure is reported first
    (``load_failed``): the launcher then resumes from the iteration before."""
    def load_checkpoint(*args, **kwargs):
        start = time.perf_counter()
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:  # reported, then raised as it was
            installation.observer.load_failed(exc)
            raise
        installation.observer.loaded(result[0], time.perf_counter() - start)
        return result
    return load_checkpoint


def wrap_train_step(original: Callable, installation: Installation) -> Callable:
    """``train_step``, which Megatron-LM's loop calls with ``iteration``, the count of
    iterations done: the observer hears iteration ``iteration + 1`` begin and end."""
    def train_step(*args, **kwargs):
        done = kwargs.get("iteration")
        if done is None:  # not from the training loop
            return original(*args, **kwargs)
        observer = installation.observer
        observer.iteration_start(done + 1)
        start = time.perf_counter()
        result = original(*args, **kwargs)
        observer.iteration_end(done + 1, reported_loss(result[0]), time.perf_counter() - start)
        return result
    return train_step


def reported_loss(loss_dict: dict) -> float | None:
    """The iteration's ``lm loss`` (``pretrain_gpt.py``'s name; else the first value)
    from ``train_step``'s report, which last pipeline stages hold."""
    if not loss_dict:
        return None
    value = loss_dict.get("lm loss", next(iter(loss_dict.values())))
    return float(value)


def between_iterations(what: str) -> Callable[[Callable, Installation], Callable]:
    """The replacement of a function the loop calls between two iterations (a save, an
    evaluation): the observer hears it begin and end."""
    def make(original: Callable, installation: Installation) -> Callable:
        def replacement(*args, **kwargs):
            installation.observer.busy(what)
            try:
                return original(*args, **kwargs)
            finally:
                installation.observer.idle()
        return replacement
    return make
