"""``elastor inspect DIR``: what a checkpoint holds, from its manifest alone."""

from __future__ import annotations

import argparse
import json
import sys

from elastor_mcore.checkpoint.format import CheckpointError, read_manifest, resolve_step_dir
from elastor_mcore.checkpoint.storage import storage_for
from elastor_mcore.parallel.layout import LayoutError, layout_from_dict


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect", help="show a checkpoint's step, layout and tensors",
        description="Print the step, the layout at save time and a table of tensors "
                    "(name, shape, dtype, inner chunk shape, bytes) of a checkpoint. DIR "
                    "is a step_N directory or a checkpoint root (its latest step), local "
                    "or an s3://BUCKET/PREFIX URL (endpoint, region and credentials from "
                    "the AWS environment).")
    parser.add_argument("dir", help="checkpoint root or step directory (or s3:// URL)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:  # the manifest alone: no torch (TensorStore only for object storage)
        step_dir = resolve_step_dir(args.dir)
        manifest = read_manifest(step_dir)
        stored = _stored(step_dir)
    except CheckpointError as exc:
        print(f"elastor inspect: {exc}", file=sys.stderr)
        return 2
    print(f"checkpoint: {step_dir}")
    print(f"step: {manifest.step}  (format version {manifest.format_version}, "
          f"written by {manifest.writers} rank(s))")
    print(f"layout at save: {_describe_layout(manifest.layout)}")
    if manifest.consumed_samples is not None:
        print(f"consumed samples: {manifest.consumed_samples}")
    tensors = sorted(manifest.tensors.items())
    rows = [(name, "x".join(map(str, t.shape)) or "scalar", t.dtype,
             "x".join(map(str, t.chunks)) or "-", f"{t.nbytes:,}") for name, t in tensors]
    header = ("name", "shape", "dtype", "chunks", "bytes")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(c.rjust(w) if i == 4 else c.ljust(w)
                        for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    total = sum(t.nbytes for _, t in tensors)
    print(f"total: {len(rows)} tensors, {total:,} bytes of data, {stored}")
    return 0


def _stored(step_dir) -> str:
    """Bytes on disk; where a listing gives no sizes (object stores), the object count."""
    storage = storage_for(step_dir)
    size = storage.stored_bytes(step_dir)
    if size is None:
        return f"{len(storage.list_files(step_dir)):,} objects"
    return f"{size:,} bytes on disk"


def _describe_layout(layout) -> str:
    if layout is None:
        return "(not recorded)"
    try:
        return layout_from_dict(layout).describe()
    except (LayoutError, TypeError, KeyError, ValueError):
        return json.dumps(layout, sort_keys=True)
