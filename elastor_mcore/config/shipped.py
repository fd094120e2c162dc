"""The recipes, hardware profiles and layouts that ship with elastor-mcore, found by name.

In a checkout they are the repository's top-level ``recipes/``; in an installed wheel
``setup.py`` has mapped that folder to ``elastor_mcore/recipes/`` as package data. So
``--recipe llama3-8b`` or ``--hardware h100-80gb`` works wherever elastor is installed,
and a path to a YAML file of one's own works as before.
"""

from __future__ import annotations

from pathlib import Path

KINDS = {"recipe": "", "hardware profile": "hardware", "layout": "layouts"}
"""What ships, and the sub-folder of the recipes folder it lives in."""


def shipped_root() -> Path:
    """The shipped recipes folder: package data when installed, else the checkout's."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "recipes"
    return installed if installed.is_dir() else package.parent / "recipes"


def shipped(kind: str) -> dict[str, Path]:
    """Name (file stem) -> file of every shipped ``kind`` (a key of ``KINDS``)."""
    folder = shipped_root() / KINDS[kind]
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def shipped_path(kind: str, name: str) -> Path:
    """The shipped ``kind`` called ``name``; ``FileNotFoundError`` listing the shipped
    ones if there is none."""
    found = shipped(kind)
    if name not in found:
        raise FileNotFoundError(f"no shipped {kind} is called {name!r}; the shipped ones "
                                f"are {', '.join(found) or 'none'}")
    return found[name]


def find_input(given: str | Path, kind: str) -> Path:
    """``given`` if it is a file, else the shipped ``kind`` of that name (with or
    without ``.yaml``); otherwise ``given`` itself, so that the caller's reader reports
    the missing file together with the shipped names."""
    path = Path(given)
    if path.is_file() or path.parent != Path("."):
        return path
    return shipped(kind).get(path.name.removesuffix(".yaml"), path)


def missing_hint(kind: str) -> str:
    """The end of a 'does not exist' message: which names would have worked."""
    return (f": give a YAML file, or the name of a shipped {kind} "
            f"({', '.join(shipped(kind)) or 'none shipped'})")


RECIPE_HELP = "recipe YAML (model + training), or a shipped recipe's name, e.g. llama3-8b"
HARDWARE_HELP = "hardware profile YAML, or a shipped profile's name, e.g. h100-80gb"
"""The help of every ``--recipe`` and ``--hardware`` flag."""
