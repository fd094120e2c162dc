"""Run settings: every setting of a training run, defined once.

Each field of :class:`RunSettings` says, in its metadata (``setting(...)``), which
commands take it as a flag (``elastor train``, ``elastor launch``, ``elastor demo`` and
the torchrun ``worker``), with its help. From that one definition come the sub-commands'
flags (``add_arguments``), the worker's argv (``to_argv``) and the worker's parsing of
it (``from_args``): a new setting reaches every process by being added here, once.
A command may change a flag's default, help or requiredness for itself
(``add_arguments(..., overrides)``). Standard library only, so building a parser
stays instant.
"""

from __future__ import annotations

import argparse
import json
import os
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Callable, Literal

Command = Literal["train", "launch", "demo", "worker"]
MalformedPolicy = Literal["skip", "fail"]
DataKind = Literal["synthetic", "jsonl", "indexed"]


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from and how they are prepared (see docs/data.md); its flags
    are ``data.config.add_data_args``, the worker receives it as JSON."""

    kind: DataKind = "synthetic"
    paths: tuple[str, ...] = ()
    """JSONL files/directories (``jsonl``) or ``.bin``/``.idx`` prefixes (``indexed``)."""
    tokenizer: str | None = None
    malformed: MalformedPolicy = "fail"
    prefetch_depth: int = 1024
    """Samples the background workers may have in flight ahead of training."""
    workers: int = 1
    """Background processes that tokenise and pack during training."""
    index_workers: int = 0
    """Processes that build the document index (0: one per CPU)."""
    cache_dir: str | None = None
    """Where the document index is cached (None: ``.elastor-index`` beside the corpus)."""
    shuffle: bool = False
    """Permute the documents of each epoch with a seed from (the run's seed, epoch)."""
    fingerprint: str | None = None
    """``prepare_data``'s fingerprint of the sample stream, set once by the launcher so
    that every rank records it in checkpoints and checks it on resume without indexing
    the corpus again (None: not known, nothing to compare)."""

    @property
    def index_processes(self) -> int:
        return self.index_workers or os.cpu_count() or 1

    def to_json(self) -> str:
        """One command-line value: how launchers hand the config to every rank."""
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "DataConfig":
        data = json.loads(text)
        return DataConfig(**{**data, "paths": tuple(data["paths"])})

    def describe(self) -> str:
        if self.kind == "synthetic":
            return "synthetic tokens"
        return f"{self.kind} {' '.join(self.paths)} (tokenizer {self.tokenizer})"


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(","))


def setting(help: str, commands: tuple[Command, ...], *, flag: str | None = None,
            metavar: str | None = None, required: bool = False, parse: Callable[[str], Any] | None = None,
            render: Callable[[Any], str] | None = None) -> dict[str, Any]:
    """A field's flag: its help, the commands that take it, and argparse details.

    ``flag`` defaults to the field's name in dashes; a ``Literal`` type gives the
    choices; ``parse``/``render`` convert a value that is neither an int, a str nor a
    bool to and from its argv text.
    """
    return {"help": help, "commands": commands, "flag": flag, "metavar": metavar,
            "required": required, "parse": parse, "render": render}


ALL: tuple[Command, ...] = ("train", "launch", "demo", "worker")


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What a training run does, as its commands and every rank see it. Objects built
    from these settings (the loaded recipe and layout, callbacks) live in ``RunConfig``
    and ``SupervisorConfig``, which hold a ``RunSettings``."""

    recipe: str = field(metadata=setting("recipe YAML (model + training)", ALL))
    layout: str | None = field(default=None, metadata=setting(
        "layout YAML file or uniform shorthand like dp2-tp2-pp2", ("train", "worker"),
        required=True))
    """Under the supervisor, each launch's planned layout (set per launch)."""
    steps: int = field(metadata=setting("optimizer steps to run", ALL))
    seed: int | None = field(default=None, metadata=setting(
        "override the recipe's seed; the run's seed initialises the weights and orders "
        "--shuffle-data epochs", ("train", "launch", "worker")))
    metrics_out: str | None = field(default=None, metadata=setting(
        "write JSON lines {step, loss, grad_norm, lr, time_s, data_wait_s, save_block_s, "
        "save_in_flight, predicted_s} "
        "here", ("train", "worker")))
    save_dir: str | None = field(default=None, metadata=setting(
        "checkpoint root, a directory or s3://BUCKET/PREFIX (endpoint and credentials "
        "from the AWS environment): saves step_<N>/ every --save-interval steps and at "
        "the end",
        ("train", "worker"), flag="--save", metavar="DIR"))
    save_interval: int = field(default=0, metadata=setting(
        "with --save: also save every K steps (default 0: only at the end)", ALL,
        metavar="K"))
    keep_checkpoints: int = field(default=2, metadata=setting(
        "committed checkpoints to keep (default 2)", ("train", "launch", "worker"),
        metavar="N"))
    async_save: bool = field(default=True, metadata=setting(
        "write checkpoints in the background; training blocks only for a copy into host "
        "buffers (default: on)", ("train", "launch", "worker")))
    save_when_busy: Literal["wait", "skip"] = field(default="wait", metadata=setting(
        "a save due while the previous one is still being written: wait for it, or skip "
        "the new one (default: wait)", ("train", "launch", "worker")))
    on_save_error: Literal["stop", "continue"] = field(default="stop", metadata=setting(
        "a failed save (e.g. a full disk) stops the run, or is logged and training "
        "continues; the previous checkpoint stays loadable either way (default: stop)",
        ("train", "launch", "worker")))
    load_dir: str | None = field(default=None, metadata=setting(
        "resume from the latest committed step under DIR (or s3://BUCKET/PREFIX), under "
        "the current layout "
        "(weights, optimizer, RNG, data position, step)", ("train", "worker"),
        flag="--load", metavar="DIR"))
    report_memory: bool = field(default=False, metadata=setting(
        "print every rank's optimizer-state bytes (fp32 main parameters and Adam "
        "moments, measured on its tensors) next to the formula: 12 bytes per parameter, "
        "divided by its replica count under training.distributed_optimizer; after the "
        "first step, every rank's measured weights, gradients, optimizer state, peak "
        "activations saved for backward and RSS (CUDA allocator peak on GPU) next to "
        "the planner's prediction for its stage",
        ("train", "worker")))
    allow_data_change: bool = field(default=False, metadata=setting(
        "resume even if the corpus or tokenizer differs from the checkpoint's (the "
        "sample stream changes; logged as a warning)", ("train", "launch", "worker")))
    data: DataConfig = field(default_factory=DataConfig, metadata=setting(
        "DataConfig as JSON (the commands' data flags build it)", ("worker",),
        flag="--data-config", parse=DataConfig.from_json, render=DataConfig.to_json))
    failure_plan: str | None = field(default=None, metadata=setting(
        "inject failures: a list of {step, slot, kind: kill|hang}", ("launch", "worker"),
        metavar="YAML"))
    hardware: str | None = field(default=None, metadata=setting(
        "hardware profile for the planner's predicted step time of the layout, printed "
        "beside the measured median (default on CPU: recipes/hardware/cpu-slots-measured"
        ".yaml)", ("train", "worker"), metavar="YAML"))
    """Under the supervisor, the profile it plans with."""
    elastic_dir: str | None = field(default=None, metadata=setting(
        "set by elastor launch: heartbeats and events of this launch", ("worker",)))
    rank_slots: tuple[int, ...] | None = field(default=None, metadata=setting(
        "set by elastor launch: physical slot of each rank, comma-separated, in rank "
        "order", ("worker",), parse=_int_list, render=lambda s: ",".join(map(str, s))))
    """Torchrun ranks are contiguous (0..n-1), the survivors' slots are not."""

    def seed_for(self, recipe_seed: int) -> int:
        """The seed of the run: ``seed`` if given, else the recipe's."""
        return recipe_seed if self.seed is None else self.seed

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, command: Command,
                      overrides: dict[str, dict[str, Any]] | None = None) -> None:
        """Add the flags ``command`` takes; ``overrides`` maps a field name to argparse
        keywords (default, help, required) that differ for this command."""
        hints = typing.get_type_hints(cls)
        for f in _fields_of(command):
            meta = f.metadata
            kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
            if meta["metavar"]:
                kwargs["metavar"] = meta["metavar"]
            if typing.get_origin(hints[f.name]) is Literal:
                kwargs["choices"] = typing.get_args(hints[f.name])
            if hints[f.name] is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = meta["parse"] or _scalar_type(hints[f.name])
            if f.default is not MISSING:
                kwargs["default"] = f.default
            elif f.default_factory is not MISSING:
                kwargs["default"] = f.default_factory()
            if "default" not in kwargs or meta["required"]:
                kwargs["required"] = True
            own = (overrides or {}).get(f.name, {})
            if "default" in own:
                kwargs.pop("required", None)  # a command's own default makes it optional
            parser.add_argument(_flag(f), **{**kwargs, **own})

    @classmethod
    def from_args(cls, args: argparse.Namespace, command: Command,
                  **values: Any) -> "RunSettings":
        """The settings ``add_arguments(parser, command)`` parsed into ``args``;
        ``values`` sets the fields the command builds itself (e.g. ``data``)."""
        parsed = {f.name: getattr(args, f.name) for f in _fields_of(command)}
        return cls(**{**parsed, **values})

    def to_argv(self) -> list[str]:
        """The worker's command line for these settings (``from_args(..., "worker")``
        reads it back)."""
        argv: list[str] = []
        for f in _fields_of("worker"):
            value = getattr(self, f.name)
            if value is None:
                continue
            flag = _flag(f)
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            else:
                render = f.metadata["render"] or str
                argv += [flag, render(value)]
        return argv


def _fields_of(command: Command) -> list:
    return [f for f in fields(RunSettings) if command in f.metadata["commands"]]


def _flag(f) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _scalar_type(hint: Any) -> Callable[[str], Any]:
    """``int`` for ``int`` and ``int | None``; ``str`` for strings and literals."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if hint is int or args == [int]:
        return int
    return str
