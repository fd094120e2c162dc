"""Measuring a hardware profile (``elastor profile``, and the supervisor before its
first launch) and finding a cached one.

The measurement runs in a torchrun world (``elastic.rank.measure``: twice the largest
TP degree measured, so that two-stage pipelines fit), given its settings
(``config.profile.MeasureSettings``) as argv; its raw figures become a profile through
``planner.calibration``. A profile counts as *measured for* a recipe on this
machine when it holds tables of the recipe's shape taken on this host and device kind.
Figures whose repetitions disagree beyond a bound (the machine's load changed while
they were taken, even after the world measured them again) are refused.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Literal

from elastor_mcore.config.profile import MeasureSettings
from elastor_mcore.config.recipe import Recipe
from elastor_mcore.elastic.torchrun import start_torchrun, torchrun_command
from elastor_mcore.planner import HardwareError, HardwareProfile, load_hardware, write_hardware
from elastor_mcore.planner.calibration import measured_profile, provenance, unstable

MEASURE_MODULE = "elastor_mcore.elastic.rank.measure"
CACHED_NAME = "hardware-profile.yaml"
"""The supervisor's cached profile, beside the run directory's checkpoints."""
SUPERVISOR_REPEATS = 5
"""Repetitions of the supervisor's own measurement: quick, as a launch waits for it."""
Device = Literal["cpu", "cuda"]


class ProfileError(RuntimeError):
    """The measurement failed; the message says where its output is."""


class UnstableProfile(ProfileError):
    """The repetitions of some figures disagreed beyond the bound; the message names them."""


def default_tp_sizes(recipe: Recipe, hardware: HardwareProfile,
                     devices: int | None = None) -> list[int]:
    """Every TP degree the model allows within a node (and, on CUDA, that fits twice
    on the visible devices)."""
    limit = hardware.gpus_per_node if devices is None else min(hardware.gpus_per_node,
                                                               devices // 2)
    return [t for t in recipe.model.valid_tp_sizes if t <= max(1, limit)]


def device_count() -> int:
    import torch
    return torch.cuda.device_count()


def measure(settings: MeasureSettings, recipe: Recipe, base: HardwareProfile, device: Device,
            on_line: Callable[[str], None] = print) -> HardwareProfile:
    """Run the measurement world of ``settings`` (its ``tp_sizes`` set) and return
    ``base`` with the measured tables and links. ``on_line`` gets the world's progress
    lines. Raises ``UnstableProfile`` when a figure's repetitions still pin its median
    down no better than ``settings.max_spread`` (the width of its 90 % confidence
    interval over the median)."""
    world = max(2, 2 * max(settings.tp_sizes))
    with tempfile.TemporaryDirectory(prefix="elastor-profile-") as tmp:
        raw_path = Path(tmp) / "raw.json"
        log_path = Path(tmp) / "torchrun.log"
        args = replace(settings, raw_out=str(raw_path)).to_argv("measure")
        with open(log_path, "w") as log_file:
            proc = start_torchrun(torchrun_command(world, MEASURE_MODULE, args),
                                  stdout=subprocess.PIPE, stderr=log_file, text=True)
            for line in proc.stdout:
                on_line(line.rstrip("\n"))
            code = proc.wait()
        if code or not raw_path.is_file():
            tail = log_path.read_text()[-3000:]
            raise ProfileError(f"the measurement world failed (exit {code}):\n{tail}")
        raw = json.loads(raw_path.read_text())
    check_stable(raw, settings.max_spread)
    spreads = [r["spread"] for r in raw["stages"]]
    measured_on = {**provenance(settings.recipe, device, settings.repeats),
                   "worst_stage_spread": round(max(spreads, default=0.0), 3),
                   "max_spread": settings.max_spread}
    return measured_profile(base, raw, recipe, measured_on)


def check_stable(raw: dict, max_spread: float) -> None:
    """Raise ``UnstableProfile`` naming the figures of ``raw`` (``elastic.rank.measure``'s
    output, measured again up to 3 times by the world) whose repetitions disagree by
    more than ``max_spread``."""
    bad = unstable(raw, max_spread)
    if bad:
        raise UnstableProfile(
            f"repetitions disagree by more than {max_spread:.0%} (the median's 90 % "
            f"confidence interval over the median) in: {'; '.join(bad)}. The machine's load changed while measuring "
            f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs); measure "
            f"again when it is quieter, with more --repeats, or accept a larger "
            f"--max-spread")


def measured_here(profile: HardwareProfile, recipe: Recipe, device: Device) -> bool:
    """Whether ``profile`` holds tables for ``recipe`` taken on this host and device kind."""
    tables = profile.measurements_for(recipe)
    return (tables is not None and tables.measured_on.get("host") == socket.gethostname()
            and tables.measured_on.get("device") == device)


@dataclass(frozen=True)
class ProfileChoice:
    """The profile a supervisor plans with, and a sentence saying which and why."""

    hardware: HardwareProfile
    path: Path
    why: str


def describe(profile: HardwareProfile, recipe: Recipe) -> str:
    tables = profile.measurements_for(recipe)
    if tables is None:
        return "analytic estimates, not measured for this recipe"
    on = tables.measured_on
    return (f"measured for {recipe.name} on {on.get('host')} at {on.get('date')}, "
            f"TP {list(tables.tp_sizes)}")


def unmeasured(profile: HardwareProfile) -> tuple[float, float, int]:
    """What a measurement keeps of the profile it starts from and the planner depends
    on: memory per GPU, its reserve, GPUs per node."""
    return profile.memory_per_gpu_gib, profile.memory_reserved_gib, profile.gpus_per_node


def choose_profile(run_dir: Path, recipe_path: str, recipe: Recipe, given: Path,
                   device: Device, measure_missing: bool,
                   on_line: Callable[[str], None]) -> ProfileChoice:
    """The cached ``<run_dir>/hardware-profile.yaml`` if it was measured here for the
    recipe on top of a profile with ``given``'s memory and node size; else ``given`` if
    it was measured here; else, with ``measure_missing``, measure once (on top of
    ``given``) and cache it; else ``given`` as it is."""
    cached = run_dir / CACHED_NAME
    base = load_hardware(given)
    if cached.is_file():
        try:
            profile = load_hardware(cached)
        except HardwareError as exc:
            on_line(f"ignoring the cached profile: {exc}")
        else:
            if measured_here(profile, recipe, device) and unmeasured(profile) == unmeasured(base):
                return ProfileChoice(profile, cached, f"cached: {describe(profile, recipe)}")
            if measured_here(profile, recipe, device):
                on_line(f"ignoring the cached profile: it was measured on top of another "
                        f"profile than {given} (memory, reserve, GPUs per node "
                        f"{unmeasured(profile)}, not {unmeasured(base)})")
    if measured_here(base, recipe, device):
        return ProfileChoice(base, given, describe(base, recipe))
    if not measure_missing:
        return ProfileChoice(base, given, describe(base, recipe))
    tp_sizes = default_tp_sizes(recipe, base, device_count() if device == "cuda" else None)
    on_line(f"measuring a hardware profile for {recipe.name} (TP {tp_sizes}), once per "
            f"run directory ...")
    settings = MeasureSettings(recipe=recipe_path, tp_sizes=tuple(tp_sizes),
                               repeats=SUPERVISOR_REPEATS)
    try:
        profile = measure(settings, recipe, base, device, on_line=on_line)
    except UnstableProfile as exc:
        on_line(f"not caching the measured profile: {exc}")
        return ProfileChoice(base, given, f"{describe(base, recipe)} (the measurement was "
                                          f"unstable)")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_hardware(profile, cached, f"Measured by the supervisor on top of {given}.")
    return ProfileChoice(load_hardware(cached), cached,
                         f"measured now and cached: {describe(profile, recipe)}")
