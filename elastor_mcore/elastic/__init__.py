"""Automatic recovery: a supervisor around torchrun that re-plans on the survivors,
or per node of a multi-node job, torch's elastic agent.

Processes only: no module here imports torch.distributed (``tests/test_architecture.py``
checks it), so the supervisor runs without a process group. Modules, one concern each:

- ``torchrun``: start and stop torchrun worlds (every CLI, tool and test launches so).
- ``heartbeat``: read the per-rank heartbeat files; the hang policy.
- ``events``: read the per-launch event log ranks append to (load, first step, failure).
- ``probe``: which devices are still alive after a failure.
- ``supervisor``: plan, launch, watch, stop, probe, re-plan, relaunch; give up.
- ``node``: one node of a multi-node job: torch's elastic agent (c10d rendezvous) for
  its slots, hang kills, the job's end; ``node_timeline``: that node's rounds and
  recoveries (the rank side of a round is ``runtime/rendezvous_round.py``).
- ``timeline``: per-failure recovery phases from supervisor records and rank events.
- ``report``: the demo's ``report.md``, ``loss.png`` and ``timeline.json``.

The rank side of the file protocol (writing heartbeats and events, injecting planned
failures) is ``runtime/rank_hooks.py``; the failure plan itself is
``config/failure_plan.py``.
"""
