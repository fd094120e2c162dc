"""The failure plan: which slot fails at which step, and how (for tests and the demo).

YAML form (a list, or a mapping with a ``failures`` list)::

    failures:
      - {step: 12, slot: 3, kind: kill}   # SIGKILL itself as it begins step 12
      - {step: 27, slot: 5, kind: hang}   # block forever as it begins step 27

Steps are 1-based, as printed: a failure at step S leaves steps 1..S-1 done. A slot
fails at most once: after its failure it counts as dead and is not relaunched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from elastor_mcore.config.yaml_file import read_yaml_file

KINDS = ("kill", "hang")


class FailurePlanError(ValueError):
    """A failure plan that cannot be run; the message names the entry and the fix."""


@dataclass(frozen=True)
class Failure:
    step: int
    """1-based step the slot's rank fails as it begins."""
    slot: int
    """Physical slot (GPU id, or CPU rank slot) whose rank fails."""
    kind: Literal["kill", "hang"]
    """``kill``: SIGKILL (a crash); ``hang``: block forever (a hung collective)."""


def parse_failure_plan(data: Any, where: str = "failure plan") -> tuple[Failure, ...]:
    """Failures from the YAML form, checked for shape only (see ``validate``)."""
    if isinstance(data, dict) and set(data) == {"failures"}:
        data = data["failures"]
    if data is None:
        return ()
    if not isinstance(data, list):
        raise FailurePlanError(f"{where}: expected a list of {{step, slot, kind}} entries "
                               f"(or a mapping with a 'failures' list), got {type(data).__name__}")
    failures = []
    for i, entry in enumerate(data):
        at = f"{where}: failures[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"step", "slot", "kind"}:
            raise FailurePlanError(f"{at} must be a mapping with exactly step, slot and kind, "
                                   f"e.g. {{step: 12, slot: 3, kind: kill}}; got {entry!r}")
        for name in ("step", "slot"):
            value = entry[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise FailurePlanError(f"{at}.{name} must be a non-negative integer, "
                                       f"got {value!r}")
        if entry["kind"] not in KINDS:
            raise FailurePlanError(f"{at}.kind is {entry['kind']!r}; use one of {list(KINDS)}")
        failures.append(Failure(entry["step"], entry["slot"], entry["kind"]))
    return tuple(failures)


def load_failure_plan(path: str | os.PathLike) -> tuple[Failure, ...]:
    return parse_failure_plan(read_yaml_file(path, "failure plan", FailurePlanError), str(path))


def validate(failures: Iterable[Failure], slots: Iterable[int], steps: int,
             where: str = "failure plan") -> None:
    """Check the plan against the run before anything starts: known slots, steps
    within the run, each slot failing at most once."""
    slots = sorted(slots)
    seen: dict[int, int] = {}
    for i, f in enumerate(failures):
        at = f"{where}: failures[{i}]"
        if f.slot not in slots:
            raise FailurePlanError(f"{at}.slot={f.slot} is not a slot of this run; the "
                                   f"slots are {slots}")
        if not 1 <= f.step <= steps:
            raise FailurePlanError(f"{at}.step={f.step} is outside the run; steps are "
                                   f"1..{steps} (a failure at step S fails as S begins)")
        if f.slot in seen:
            raise FailurePlanError(f"{at}: slot {f.slot} already fails in failures"
                                   f"[{seen[f.slot]}]; a failed slot is dead afterwards, "
                                   f"so list each slot at most once")
        seen[f.slot] = i
