"""The event log of one launch: JSON lines that ranks append, the supervisor reads.

Ranks record what only they can time (the checkpoint load, the first step after it,
an injected failure) with wall-clock timestamps; the supervisor joins them with its own
records into the recovery timeline. Each event is one ``write`` of one line to a file
opened for appending, so lines from concurrent ranks never interleave. Writing and
reading live in ``runtime.rank_hooks`` (ranks read their node's past failures too).
"""

from __future__ import annotations

from elastor_mcore.runtime.rank_hooks import EVENTS_FILE, append_event, read_events

__all__ = ["EVENTS_FILE", "append_event", "read_events"]
