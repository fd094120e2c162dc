"""Measurement settings: what ``elastor profile`` measures, defined once for the command
and for the measurement world it starts (``measure``, ``elastic.rank.measure``), which
reads back the argv ``to_argv("measure")`` builds (``config.flags``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from elastor_mcore.config.flags import Command, Flags, int_list, render_list, setting
from elastor_mcore.config.shipped import RECIPE_HELP

DEFAULT_MAX_SPREAD = 0.25
"""The default bound on a figure's spread (the width of its median's confidence
interval over the median, ``planner.calibration.robust``)."""
DEFAULT_REPEATS = 30
"""The default repetitions: with 30 the median's 90 % interval runs from the 11th to
the 20th of them (with 10, from the 2nd to the 9th)."""

BOTH: tuple[Command, ...] = ("profile", "measure")


@dataclass(frozen=True, kw_only=True)
class MeasureSettings(Flags):
    """What a measurement takes: ``elastor profile``'s flags, and the world's."""

    recipe: str = field(metadata=setting(RECIPE_HELP, BOTH))
    hardware: str | None = field(default=None, metadata=setting(
        "profile to start from: memory, inter-node links and what is not measured "
        "(default on CPU: recipes/hardware/cpu-slots.yaml; required on CUDA)", BOTH))
    """In the world, only with ``profile_out``."""
    out: str | None = field(default=None, metadata=setting(
        "write the measured profile here (YAML)", ("profile",), required=True))
    tp_sizes: tuple[int, ...] | None = field(default=None, metadata=setting(
        "comma-separated TP degrees to measure (default: all the model allows within a "
        "node); the world is twice the largest", BOTH, parse=int_list, render=render_list))
    """The world needs them (the command fills in its default)."""
    repeats: int = field(default=DEFAULT_REPEATS, metadata=setting(
        "timed repetitions per measurement, interleaved with the others of its kind; the "
        "median is kept (default %(default)s)", BOTH))
    max_spread: float = field(default=DEFAULT_MAX_SPREAD, metadata=setting(
        "refuse figures whose median's 90%% confidence interval is wider than this "
        "fraction of the median after 3 attempts (default %(default)s)", BOTH))
    devices: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata=setting(
        "measure CPU slots or CUDA devices (default: cuda if available)", ("profile",)))
    raw_out: str | None = field(default=None, metadata=setting(
        "JSON file for the raw figures (rank 0 writes it)", ("measure",), flag="--out",
        required=True))
    links_only: bool = field(default=False, metadata=setting(
        "measure P2P and all-reduce only (no stages, no core sharing)", ("measure",),
        negatable=False))
    profile_out: str | None = field(default=None, metadata=setting(
        "rank 0 also writes the hardware profile here (with --hardware: the profile to "
        "start from)", ("measure",)))

    def check(self) -> None:
        """Raise ``ValueError`` naming the flag of a value no measurement can take."""
        if self.repeats < 3:
            raise ValueError(f"--repeats must be at least 3 (medians), got {self.repeats}")
        if not self.max_spread > 0:
            raise ValueError(f"--max-spread must be a positive fraction, got {self.max_spread}")
        if self.profile_out and not self.hardware:
            raise ValueError("--profile-out needs --hardware (the profile to start from)")
