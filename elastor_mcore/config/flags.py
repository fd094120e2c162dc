"""Command-line flags defined once, on the fields of settings dataclasses.

A field's metadata (``setting(...)``) says which commands take it as a flag, with its
help. From that one definition come a command's flags (``Flags.add_arguments``), the
parsed settings (``Flags.from_args``) and the argv one process builds for another
(``Flags.to_argv``), which the receiving command's ``from_args`` reads back: a setting
reaches every process by being defined once. A command may change a flag's default,
help or requiredness for itself (``add_arguments(..., overrides)``). Help texts say
``%(default)s`` rather than repeating a default. Fields without ``setting`` metadata
are not flags (the command sets them itself). Standard library only, so building a
parser stays instant.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, Field, fields
from typing import Any, Callable, Literal, Self

Command = Literal["train", "launch", "demo", "worker", "node-worker", "megatron-worker",
                  "profile", "measure"]
"""The commands whose flags are defined here: the sub-commands ``elastor train``,
``launch``, ``demo`` and ``profile``, and the entry points their processes start:
the training rank (``worker``), a multi-node round's rank (``node-worker``), a rank
of Megatron-LM's ``pretrain_gpt.py`` under the launcher (``megatron-worker``) and the
measurement world (``measure``)."""


def setting(help: str | None, commands: tuple[Command, ...], *, flag: str | None = None,
            aliases: tuple[str, ...] = (), metavar: str | None = None, required: bool = False,
            parse: Callable[[str], Any] | None = None,
            render: Callable[[Any], str] | None = None, negatable: bool = True,
            consts: tuple[tuple[str, Any, str], ...] = ()) -> dict[str, Any]:
    """A field's flag: its help, the commands that take it, and argparse details.

    ``flag`` defaults to the field's name in dashes (``aliases`` are other spellings a
    parser accepts, e.g. torchrun's name for it); a ``Literal`` type gives the
    choices; ``parse``/``render`` convert a value that is neither a number, a str nor a
    bool to and from its argv text. A bool flag is ``--x/--no-x`` unless not
    ``negatable`` (then ``--x`` alone sets it). ``consts`` makes the field a choice
    between mutually exclusive flags instead, each ``(flag, value, help)``.
    """
    return {"help": help, "commands": commands, "flag": flag, "aliases": aliases,
            "metavar": metavar,
            "required": required, "parse": parse, "render": render, "negatable": negatable,
            "consts": consts}


def nested() -> dict[str, Any]:
    """Metadata of a field holding another ``Flags`` dataclass: its fields are flags of
    the same commands, in its place."""
    return {"nested": True}


def int_list(text: str) -> tuple[int, ...]:
    """``parse`` of a comma-separated list of ints (``render_list`` writes one)."""
    return tuple(int(s) for s in text.split(","))


def render_list(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


class Flags:
    """Mixin of a dataclass whose fields carry ``setting`` (or ``nested``) metadata."""

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, command: Command,
                      overrides: dict[str, dict[str, Any]] | None = None) -> None:
        """Add the flags ``command`` takes to ``parser`` (or one of its argument
        groups); ``overrides`` maps a field name to argparse keywords (default, help,
        required, metavar) that differ for this command."""
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.metadata.get("nested"):
                hints[f.name].add_arguments(parser, command, overrides)
            elif command in f.metadata.get("commands", ()):
                _add_flag(parser, f, hints[f.name], (overrides or {}).get(f.name, {}))

    @classmethod
    def from_args(cls, args: argparse.Namespace, command: Command, **values: Any) -> Self:
        """The settings ``add_arguments(parser, command)`` parsed into ``args``;
        ``values`` sets the fields the command builds itself."""
        hints = typing.get_type_hints(cls)
        parsed = {}
        for f in fields(cls):
            if f.metadata.get("nested"):
                parsed[f.name] = hints[f.name].from_args(args, command)
            elif command in f.metadata.get("commands", ()):
                parsed[f.name] = getattr(args, f.name)
        return cls(**{**parsed, **values})

    @classmethod
    def given(cls, args: argparse.Namespace, command: Command) -> list[str]:
        """The flags of ``command`` that ``args`` sets to other than their field's
        default (for a command that refuses some flags in some mode)."""
        hints = typing.get_type_hints(cls)
        flags = []
        for f in fields(cls):
            if f.metadata.get("nested"):
                flags += hints[f.name].given(args, command)
            elif command in f.metadata.get("commands", ()) and \
                    getattr(args, f.name, None) not in (None, _default(f)):
                flags.append(_flag_of(f))
        return flags

    def to_argv(self, command: Command) -> list[str]:
        """The command line that gives ``command`` these settings (``from_args`` of its
        parser reads them back); unset (None) values are left out."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("nested"):
                argv += value.to_argv(command)
            elif command in f.metadata.get("commands", ()) and value is not None:
                argv += _flag_argv(f, value)
        return argv


def _add_flag(parser, f: Field, hint: Any, own: dict[str, Any]) -> None:
    meta = f.metadata
    default = _default(f)
    if meta["consts"]:
        choice = parser.add_mutually_exclusive_group()
        for flag, value, help in meta["consts"]:
            choice.add_argument(flag, dest=f.name, action="store_const", const=value,
                                default=default, help=help)
        return
    kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
    if meta["metavar"]:
        kwargs["metavar"] = meta["metavar"]
    if typing.get_origin(hint) is Literal:
        kwargs["choices"] = typing.get_args(hint)
    if hint is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if meta["negatable"] else "store_true"
    else:
        kwargs["type"] = meta["parse"] or _scalar_type(hint)
    if default is not MISSING:
        kwargs["default"] = default
    if default is MISSING or meta["required"]:
        kwargs["required"] = True
    if "default" in own:
        kwargs.pop("required", None)  # a command's own default makes it optional
    parser.add_argument(_flag_of(f), *meta["aliases"], **{**kwargs, **own})


def _flag_argv(f: Field, value: Any) -> list[str]:
    meta = f.metadata
    if meta["consts"]:
        return [next(flag for flag, const, _ in meta["consts"] if const == value)]
    flag = _flag_of(f)
    if isinstance(value, bool):
        if meta["negatable"]:
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value else []
    return [flag, (meta["render"] or str)(value)]


def _default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _flag_of(f: Field) -> str:
    """The flag of a field: ``setting(flag=...)``, else its name in dashes."""
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _scalar_type(hint: Any) -> Callable[[str], Any]:
    """``int``/``float`` for those types with or without ``None``; ``str`` otherwise."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    for number in (int, float):
        if hint is number or args == [number]:
            return number
    return str
