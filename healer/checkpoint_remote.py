"""Where a checkpoint search runs besides a local directory: object-store prefixes (through fsspec) and the
node agent that searched inside a job's pod (its answer travels as JSON)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

from healer.checkpoints import Checkpoint, CheckpointFormat, Discovery, discover

OBJECT_STORE_SCHEMES = ("s3", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2")
"""URL schemes searched through fsspec (s3fs, gcsfs, adlfs: install the one your store needs)."""


def is_object_store_url(path: str) -> bool:
    """``s3://bucket/run-7/checkpoints`` and the like."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() in OBJECT_STORE_SCHEMES


def object_store_path(url: str) -> Path:
    """A pathlib-style view of an object-store prefix (universal-pathlib over fsspec).

    Credentials and endpoints come from the environment as each store's own SDK reads them
    (``AWS_*``/``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_*``), so the
    Deployment configures them the usual way. The checks above use only ``/``, ``glob``,
    ``iterdir``, ``is_file``, ``is_dir``, ``exists``, ``open``, ``read_text`` and ``stat``, which
    UPath provides with pathlib's meaning: it stands in for a Path there.
    """
    from upath import UPath  # imported on use: the node agent never needs fsspec

    return cast(Path, UPath(url))


def discovery_to_json(found: Discovery) -> dict[str, Any]:
    """A search's result as JSON (what a node agent answers)."""
    latest = None if found.latest is None else {
        "path": found.latest.path, "step": found.latest.step, "format": found.latest.format.value}
    return {"latest": latest, "skipped": [list(s) for s in found.skipped]}


def discovery_from_json(text: str) -> Discovery:
    """An agent's answer back into a Discovery; anything malformed is a search that found nothing."""
    try:
        raw = json.loads(text)
        latest = raw.get("latest")
        ck = None if not latest else Checkpoint(CheckpointFormat(latest["format"]), str(latest["path"]),
                                                int(latest["step"]))
        skipped = tuple((str(p), str(w)) for p, w in raw.get("skipped", []))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return Discovery(None, (("(agent answer)", f"unreadable: {exc}"),))
    return Discovery(ck, skipped)


def discover_json(root: os.PathLike[str]) -> dict[str, Any]:
    """``discover`` for the node agent: a local directory in, JSON out."""
    return discovery_to_json(discover(Path(root), roots=(os.fspath(root),)))
