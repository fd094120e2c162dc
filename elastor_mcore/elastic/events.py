"""The event log of one launch: JSON lines that ranks append, the supervisor reads.

Ranks record what only they can time (the checkpoint load, the first step after it,
an injected failure) with wall-clock timestamps; the supervisor joins them with its own
records into the recovery timeline. Each event is one ``write`` of one line to a file
opened for appending, so lines from concurrent ranks never interleave.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from elastor_mcore.runtime.rank_hooks import EVENTS_FILE



def read_events(path: str | os.PathLike, event: str | None = None) -> list[dict[str, Any]]:
    """Every complete event in the file (optionally only those named ``event``)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a SIGKILL mid-write
        if event is None or record.get("event") == event:
            records.append(record)
    return records
