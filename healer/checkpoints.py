"""Checkpoint discovery: the latest COMPLETE checkpoint under a job's checkpoint path.

Knows the layouts of PyTorch DCP (``.metadata`` + every shard it names), DeepSpeed (``latest`` +
``global_stepN/`` with every rank's files), Megatron-LM (``latest_checkpointed_iteration.txt`` +
``iter_NNNNNNN/``) and Hugging Face Trainer (``checkpoint-N/`` with ``trainer_state.json``). A newer
checkpoint that is partial, truncated or unreadable is skipped and reported — never deleted.

Reads files only; torch is not needed: DCP metadata is read with an unpickler that builds inert
placeholders instead of importing any class, and ``.pt`` files are checked as the zip archives
``torch.save`` writes.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, cast


class CheckpointFormat(StrEnum):
    """Layouts kmend recognises."""

    DCP = "torch_dcp"
    DEEPSPEED = "deepspeed"
    MEGATRON = "megatron"
    HF = "huggingface"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One complete checkpoint."""

    format: CheckpointFormat
    """Its layout."""
    path: str
    """Directory to resume from."""
    step: int
    """Training step or iteration."""


@dataclass(frozen=True, slots=True)
class Discovery:
    """What a search found."""

    latest: Checkpoint | None
    """The newest complete checkpoint, if any."""
    skipped: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    """Newer checkpoints passed over: (path, why)."""
    formats: tuple[CheckpointFormat, ...] = ()
    """Layouts seen under the root."""


class Incomplete(Exception):
    """A checkpoint that cannot be resumed from; the message says why."""


_STEP = re.compile(r"(\d+)(?!.*\d)")


def _step_of(name: str) -> int | None:
    m = _STEP.search(name)
    return int(m.group(1)) if m else None


# -- PyTorch distributed checkpoint ---------------------------------------------------------


class _Inert:
    """Stands in for any class named in a pickle; records its arguments and state."""

    args: tuple[Any, ...] = ()
    state: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert(*args)


class _InertUnpickler(pickle.Unpickler):
    """Builds only containers and _Inert placeholders: no code from the file ever runs."""

    _SAFE = {("builtins", "set"), ("builtins", "frozenset"), ("builtins", "tuple"), ("builtins", "list"),
             ("builtins", "dict"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._SAFE:
            return super().find_class(module, name)
        return type(name, (_Inert,), {})

    def persistent_load(self, pid: Any) -> Any:
        return _Inert(pid)


def _walk(obj: Any, depth: int = 0) -> Iterator[Any]:
    if depth > 60:
        return
    yield obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(k, depth + 1)
            yield from _walk(v, depth + 1)
    elif isinstance(obj, list | tuple | set | frozenset):
        for v in obj:
            yield from _walk(v, depth + 1)
    elif isinstance(obj, _Inert):
        yield from _walk(obj.args, depth + 1)
        yield from _walk(obj.state, depth + 1)


def _state_fields(obj: _Inert) -> dict[str, Any]:
    st = obj.state
    if isinstance(st, tuple) and len(st) == 2:  # (dict state, slots state)
        merged: dict[str, Any] = {}
        for part in st:
            if isinstance(part, dict):
                merged.update(part)
        return merged
    return dict(st) if isinstance(st, dict) else {}


def check_dcp(path: Path) -> None:
    """A DCP checkpoint is complete when ``.metadata`` reads and every byte range it names is on disk."""
    meta = path / ".metadata"
    if not meta.is_file():
        raise Incomplete(".metadata missing (the save did not finish)")
    try:
        with meta.open("rb") as f:
            obj = _InertUnpickler(f).load()
    except Exception as exc:
        raise Incomplete(f".metadata unreadable: {type(exc).__name__}: {exc}") from None
    needed: dict[str, int] = {}
    for node in _walk(obj):
        if isinstance(node, _Inert):
            fields = _state_fields(node)
            rel, offset, length = fields.get("relative_path"), fields.get("offset"), fields.get("length")
            if isinstance(rel, str) and isinstance(offset, int) and isinstance(length, int):
                needed[rel] = max(needed.get(rel, 0), offset + length)
    if not needed:
        raise Incomplete(".metadata names no shards")
    for rel, end in sorted(needed.items()):
        shard = path / rel
        if not shard.is_file():
            raise Incomplete(f"shard {rel} missing")
        size = shard.stat().st_size
        if size < end:
            raise Incomplete(f"shard {rel} truncated: {size} bytes, metadata needs {end}")


# -- torch.save files and safetensors ---------------------------------------------------------


def check_torch_file(path: Path) -> None:
    """A ``torch.save`` file is a zip archive; a truncated one has no readable central directory."""
    if not path.is_file():
        raise Incomplete(f"{path.name} missing")
    if path.stat().st_size == 0:
        raise Incomplete(f"{path.name} is empty")
    try:
        with path.open("rb") as fh, zipfile.ZipFile(fh) as z:  # a file object: object-store paths too
            if not z.namelist():
                raise Incomplete(f"{path.name} holds nothing")
    except zipfile.BadZipFile:
        raise Incomplete(f"{path.name} truncated or corrupt (no zip central directory)") from None


def check_safetensors(path: Path) -> None:
    """The header names every tensor's byte range; the file must hold them all."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise Incomplete(f"{path.name} truncated (no header)")
            (n,) = struct.unpack("<Q", raw)
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        raise Incomplete(f"{path.name} unreadable: {exc}") from None
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if path.stat().st_size < 8 + n + end:
        raise Incomplete(f"{path.name} truncated: {path.stat().st_size} bytes, header needs {8 + n + end}")


# -- the four layouts -------------------------------------------------------------------------------


def _deepspeed(tag_dir: Path) -> None:
    models = sorted(tag_dir.glob("*mp_rank_*_model_states.pt"))
    if not models:
        raise Incomplete("no mp_rank_*_model_states.pt")
    for m in models:
        check_torch_file(m)
    optim = sorted(tag_dir.glob("*zero_pp_rank_*_optim_states.pt"))
    ranks = sorted({int(hit.group(1)) for o in optim if (hit := re.search(r"zero_pp_rank_(\d+)_", o.name))})
    if ranks and ranks != list(range(ranks[-1] + 1)):
        missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
        raise Incomplete(f"optimizer states of rank(s) {missing} missing")
    for o in optim:
        check_torch_file(o)


def _megatron(it_dir: Path) -> None:
    if (it_dir / ".metadata").exists() or (it_dir / "metadata.json").exists():
        check_dcp(it_dir)
        return
    ranks = sorted(d for d in it_dir.iterdir() if d.is_dir() and d.name.startswith("mp_rank_"))
    if not ranks:
        raise Incomplete("no mp_rank_* directories")
    for d in ranks:
        files = list(d.glob("*.pt"))
        if not files:
            raise Incomplete(f"{d.name} holds no model_optim_rng.pt")
        for f in files:
            check_torch_file(f)


def _huggingface(ck: Path) -> None:
    state = ck / "trainer_state.json"
    if not state.is_file():
        raise Incomplete("trainer_state.json missing")
    try:
        json.loads(state.read_text())
    except ValueError as exc:
        raise Incomplete(f"trainer_state.json unreadable: {exc}") from None
    index = next(iter(sorted(ck.glob("*.safetensors.index.json"))), None)
    if index is not None:
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError) as exc:
            raise Incomplete(f"{index.name} unreadable: {exc}") from None
        for s in sorted(shards):
            if not (ck / s).is_file():
                raise Incomplete(f"weight shard {s} missing")
            check_safetensors(ck / s)
        return
    single = [p for p in ck.glob("*.safetensors")]
    for s in single:
        check_safetensors(s)
    bins = list(ck.glob("pytorch_model*.bin"))
    for b in bins:
        check_torch_file(b)
    if not single and not bins and not (ck / ".metadata").exists():
        raise Incomplete("no model weights")
    if (ck / ".metadata").exists():
        check_dcp(ck)


def _candidates(root: Path) -> Iterator[tuple[CheckpointFormat, Path, int]]:
    """Every checkpoint directory under root, with its format and step."""
    if (root / "latest").is_file() or any(root.glob("global_step*")):
        for d in root.glob("global_step*"):
            if d.is_dir() and (s := _step_of(d.name)) is not None:
                yield CheckpointFormat.DEEPSPEED, d, s
    if (root / "latest_checkpointed_iteration.txt").is_file() or any(root.glob("iter_*")):
        for d in root.glob("iter_*"):
            if d.is_dir() and (s := _step_of(d.name)) is not None:
                yield CheckpointFormat.MEGATRON, d, s
    for d in root.glob("checkpoint-*"):
        if d.is_dir() and (s := _step_of(d.name)) is not None:
            yield CheckpointFormat.HF, d, s
    for d in root.iterdir() if root.is_dir() else ():
        other = d.is_dir() and not d.name.startswith(("global_step", "iter_", "checkpoint-"))
        if other and ((d / ".metadata").exists() or any(d.glob("*.distcp"))):
            yield CheckpointFormat.DCP, d, _step_of(d.name) or 0
    if (root / ".metadata").exists():
        yield CheckpointFormat.DCP, root, _step_of(root.name) or 0


_CHECKS = {CheckpointFormat.DCP: check_dcp, CheckpointFormat.DEEPSPEED: _deepspeed,
           CheckpointFormat.MEGATRON: _megatron, CheckpointFormat.HF: _huggingface}


def discover(root: Path) -> Discovery:
    """The newest complete checkpoint under `root`, and the newer ones that were skipped and why."""
    if not root.is_dir():
        return Discovery(None, ((str(root), "checkpoint path does not exist"),))
    found = sorted(_candidates(root), key=lambda c: (c[2], c[1].stat().st_mtime), reverse=True)
    skipped: list[tuple[str, str]] = []
    for fmt, path, step in found:
        try:
            _CHECKS[fmt](path)
        except Incomplete as exc:
            skipped.append((str(path), str(exc)))
            continue
        except OSError as exc:
            skipped.append((str(path), f"unreadable: {exc}"))
            continue
        return Discovery(Checkpoint(fmt, str(path), step), tuple(skipped), tuple(sorted({f for f, _, _ in found})))
    return Discovery(None, tuple(skipped), tuple(sorted({f for f, _, _ in found})))


# -- object stores and answers from node agents ----------------------------------------------------

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
    return discovery_to_json(discover(Path(root)))
