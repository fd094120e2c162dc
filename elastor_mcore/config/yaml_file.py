"""Reading the project's YAML inputs (recipes, layouts, hardware profiles, failure
plans) with one kind of error message: which file, and what is wrong with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_yaml_file(path: str | Path, what: str, error: type[Exception]) -> Any:
    """The parsed content of ``path``; ``error`` (naming ``what`` and the file) if it is
    missing or not valid YAML."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {path} does not exist")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise error(f"{what} {path} is not valid YAML: {exc}") from None
