"""Automatic recovery: a supervisor around torchrun that re-plans on the survivors.

Modules, one concern each (none imports torch.distributed; the supervisor side runs
without a process group):

- ``failures``: the failure plan (which slot fails at which step, how) and injection.
- ``heartbeat``: per-rank heartbeat files, written by ranks, read by the supervisor.
- ``events``: the per-launch event log ranks append to (load, first step, failure).
- ``rank_hooks``: the ``train.RankHooks`` the worker runs under ``elastor launch``,
  and the worker flags that carry them.
- ``probe``: which devices are still alive after a failure.
- ``supervisor``: plan, launch, watch, stop, probe, re-plan, relaunch; give up.
- ``timeline``: per-failure recovery phases from supervisor records and rank events.
- ``report``: the demo's ``report.md``, ``loss.png`` and ``timeline.json``.
"""
