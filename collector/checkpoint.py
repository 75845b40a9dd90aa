"""Read positions per source, persisted atomically so a restart resumes without loss."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class CheckpointStore:
    """``{source: {key: cursor}}`` in one JSON file, replaced atomically on save."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._data: dict[str, dict[str, Any]] = {}
        self._dirty = False
        self.recovered = False
        """The file was unreadable and set aside; reading restarted from the beginning."""
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raw = {}
        except ValueError:
            # save() never leaves a torn file, so this is outside damage. Starting over
            # re-ships old lines, which the service drops by id: duplicates, not loss.
            path.replace(path.with_name(path.name + ".corrupt"))
            self.recovered = True
            raw = {}
        if isinstance(raw, dict):
            self._data = {str(k): dict(v) for k, v in raw.items() if isinstance(v, dict)}

    def section(self, source: str) -> dict[str, Any]:
        """A copy of one source's saved cursors (what it resumes from)."""
        return dict(self._data.get(source, {}))

    def update(self, source: str, cursors: Mapping[str, Any]) -> None:
        """Record cursors; a ``None`` value forgets the key."""
        if not cursors:
            return
        sect = self._data.setdefault(source, {})
        for key, value in cursors.items():
            if value is None:
                sect.pop(key, None)
            else:
                sect[key] = value
        self._dirty = True

    def save(self) -> None:
        """Write to a temporary file, fsync, rename over the old one."""
        if not self._dirty:
            return
        write_json_atomically(self.path, self._data)
        self._dirty = False


def write_json_atomically(path: Path, data: Any) -> None:
    """Write to a temporary file, fsync, rename over the old one: a crash leaves the old file or the new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh, separators=(",", ":"))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
