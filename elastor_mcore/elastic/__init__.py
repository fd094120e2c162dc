"""Automatic recovery: a supervisor around torchrun that re-plans on the survivors,
or per node of a multi-node job, torch's elastic agent.

The supervisor side runs without a process group: no module here outside ``rank/``
imports torch.distributed or ``rank/`` (``tests/test_architecture.py`` checks both).
Modules, one concern each:

- ``protocol``: the files the supervisor and its ranks share (event log, heartbeat
  files, a node's round records), a leaf that both sides import.
- ``job``: what the supervisor and a node launcher share (``JobConfig``) and what the
  ranks run (``Workload``: the project's trainer is ``Trainer``).
- ``megatron``: Megatron-LM's own ``pretrain_gpt.py`` as a workload (``MegatronLM``).
- ``torchrun``: start and stop torchrun worlds (every CLI, tool and test launches so).
- ``heartbeat``: the hang policy.
- ``probe``: which devices are still alive after a failure.
- ``supervisor``: plan, launch, watch, stop, probe, re-plan, relaunch; give up.
- ``node``: one node of a multi-node job: torch's elastic agent (c10d rendezvous) for
  its slots, hang kills, the job's end; ``node_timeline``: that node's rounds and
  recoveries.
- ``profiling``: measure a hardware profile in a torchrun world, choose the one to plan
  with.
- ``timeline``: per-failure recovery phases from supervisor records and rank events.
- ``report``: the demo's ``report.md``, ``loss.png`` and ``timeline.json``.
- ``rank/``: what runs inside the ranks: entry points (the trainer's, and Megatron-LM's
  ``megatron``), a round's agreement, the training loop's elastic hooks, the
  measurement world.

The failure plan itself is ``config/failure_plan.py``; the launcher's flags are
``config/launch.py``.
"""
