"""Reading the project's YAML inputs (recipes, layouts, hardware profiles, failure
plans) with one kind of error message: which file, and what is wrong with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from elastor_mcore.config.shipped import find_input, missing_hint


def read_yaml_file(path: str | Path, what: str, error: type[Exception],
                   shipped_kind: str | None = None) -> Any:
    """The parsed content of ``path``; ``error`` (naming ``what`` and the file) if it is
    missing or not valid YAML. With ``shipped_kind`` (a key of ``shipped.KINDS``) a bare
    name that is not a file names a shipped one (``llama3-8b``, ``h100-80gb``)."""
    path = find_input(path, shipped_kind) if shipped_kind else Path(path)
    if not path.is_file():
        hint = missing_hint(shipped_kind) if shipped_kind else ""
        raise error(f"{what} {path} does not exist{hint}")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise error(f"{what} {path} is not valid YAML: {exc}") from None
