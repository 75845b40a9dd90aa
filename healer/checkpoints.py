"""Checkpoint discovery: the latest COMPLETE checkpoint under a job's checkpoint path.

Knows the layouts of PyTorch DCP (``.metadata`` + every shard it names), DeepSpeed (``latest`` +
``global_stepN/`` with every rank's files), Megatron-LM (``latest_checkpointed_iteration.txt`` +
``iter_NNNNNNN/``) and Hugging Face Trainer (``checkpoint-N/`` with ``trainer_state.json``). A newer
checkpoint that is partial, truncated or unreadable is skipped and reported — never deleted.

Reads files only; torch is not needed: DCP metadata is read with an unpickler that builds inert
placeholders instead of importing any class, and ``.pt`` files are checked as the zip archives
``torch.save`` writes.

The path comes from a pod annotation, so every search is bounded: only under the allowed roots,
never through a symlink that leaves the checkpoint root, and within a budget of objects walked,
directory entries listed, header bytes read and seconds (``Limits``). A search over budget stops
and says so; it never hangs the healer.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path, PurePath
from typing import Any


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


class OverBudget(Exception):
    """The search used up its budget (objects, entries, bytes or time); the message says which."""


MAX_SAFETENSORS_HEADER = 100_000_000
"""The safetensors format's own limit on its JSON header."""


@dataclass(frozen=True, slots=True)
class Limits:
    """The most one search may do."""

    max_objects: int = 2_000_000
    """Objects walked in DCP metadata (shared references count once)."""
    max_entries: int = 200_000
    """Directory entries listed."""
    max_bytes: int = 512 * 1024 * 1024
    """Metadata, header and JSON bytes read (shard contents are never read, only their sizes)."""
    max_seconds: float = 60.0
    """Wall time of the whole search."""


class Work:
    """Budget and boundary of one search."""

    def __init__(self, limits: Limits | None = None, *, boundary: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or Limits()
        self.boundary = boundary
        """Real path everything read must stay under (None: no boundary, for direct checks)."""
        self._clock = clock
        self._deadline = clock() + self.limits.max_seconds
        self.objects = self.entries = self.bytes = 0

    def _check_time(self) -> None:
        if self._clock() > self._deadline:
            raise OverBudget(f"search took longer than {self.limits.max_seconds:g} s")

    def objects_walked(self, n: int = 1) -> None:
        """Charge objects walked in metadata."""
        self.objects += n
        if self.objects > self.limits.max_objects:
            raise OverBudget(f"metadata holds more than {self.limits.max_objects} objects")
        if self.objects % 4096 == 0:
            self._check_time()

    def listed(self, n: int = 1) -> None:
        """Charge directory entries listed."""
        self.entries += n
        if self.entries > self.limits.max_entries:
            raise OverBudget(f"more than {self.limits.max_entries} directory entries")
        self._check_time()

    def read(self, n: int) -> None:
        """Charge bytes about to be read (refused before they are read)."""
        self.bytes += n
        if self.bytes > self.limits.max_bytes:
            raise OverBudget(f"more than {self.limits.max_bytes} bytes of metadata and headers")
        self._check_time()

    def inside(self, path: Path) -> bool:
        """Whether `path`, symlinks resolved, stays under the boundary."""
        return self.boundary is None or _under(os.path.realpath(path), self.boundary)

    def guard(self, path: Path) -> None:
        """Refuse a path that a symlink or ``..`` takes out of the checkpoint root."""
        if not self.inside(path):
            raise Incomplete(f"{path} leads outside the checkpoint root (symlink or '..'): not followed")

    def listdir(self, d: Path, pattern: str = "*") -> list[Path]:
        """Entries of `d` matching a glob pattern, charged to the budget; `d` itself must stay inside."""
        if not self.inside(d):
            return []
        out: list[Path] = []
        if not isinstance(d, PurePath):  # an object-store prefix: listed through fsspec
            for child in d.iterdir():
                self.listed()
                if PurePath(child.name).match(pattern):
                    out.append(child)
            return sorted(out, key=lambda p: p.name)
        with os.scandir(d) as it:
            for e in it:
                self.listed()
                if Path(e.name).match(pattern):
                    out.append(d / e.name)
        return sorted(out)


def _under(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _default_work(work: Work | None) -> Work:
    return work if work is not None else Work()


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


def _walk(obj: Any, work: Work) -> Iterator[Any]:
    """Every object reachable from `obj`, each once: a pickle's shared references cannot multiply the walk."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen:  # every object stays alive in `obj`, so ids are not reused during the walk
            continue
        seen.add(id(o))
        work.objects_walked()
        yield o
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list | tuple | set | frozenset):
            stack.extend(o)
        elif isinstance(o, _Inert):
            stack.append(o.args)
            stack.append(o.state)


def _state_fields(obj: _Inert) -> dict[str, Any]:
    st = obj.state
    if isinstance(st, tuple) and len(st) == 2:  # (dict state, slots state)
        merged: dict[str, Any] = {}
        for part in st:
            if isinstance(part, dict):
                merged.update(part)
        return merged
    return dict(st) if isinstance(st, dict) else {}


def check_dcp(path: Path, work: Work | None = None) -> None:
    """A DCP checkpoint is complete when ``.metadata`` reads and every byte range it names is on disk."""
    work = _default_work(work)
    meta = path / ".metadata"
    if not meta.is_file():
        raise Incomplete(".metadata missing (the save did not finish)")
    work.guard(meta)
    work.read(meta.stat().st_size)
    try:
        with meta.open("rb") as f:
            obj = _InertUnpickler(f).load()
    except Exception as exc:
        raise Incomplete(f".metadata unreadable: {type(exc).__name__}: {exc}") from None
    needed: dict[str, int] = {}
    for node in _walk(obj, work):
        if isinstance(node, _Inert):
            fields = _state_fields(node)
            rel, offset, length = fields.get("relative_path"), fields.get("offset"), fields.get("length")
            if isinstance(rel, str) and isinstance(offset, int) and isinstance(length, int):
                needed[rel] = max(needed.get(rel, 0), offset + length)
    if not needed:
        raise Incomplete(".metadata names no shards")
    for rel, end in sorted(needed.items()):
        shard = path / rel
        work.guard(shard)
        if not shard.is_file():
            raise Incomplete(f"shard {rel} missing")
        size = shard.stat().st_size
        if size < end:
            raise Incomplete(f"shard {rel} truncated: {size} bytes, metadata needs {end}")


# -- torch.save files and safetensors ---------------------------------------------------------


def check_torch_file(path: Path, work: Work | None = None) -> None:
    """A ``torch.save`` file is a zip archive; a truncated one has no readable central directory."""
    _default_work(work).guard(path)
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


def check_safetensors(path: Path, work: Work | None = None) -> None:
    """The header names every tensor's byte range; the file must hold them all."""
    work = _default_work(work)
    work.guard(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise Incomplete(f"{path.name} truncated (no header)")
            (n,) = struct.unpack("<Q", raw)
            # The length is checked before anything is read: a forged 2**62 must not become an allocation.
            if n > MAX_SAFETENSORS_HEADER or n > size - 8:
                raise Incomplete(f"{path.name} header length {n} is impossible for a {size}-byte file "
                                 f"(limit {MAX_SAFETENSORS_HEADER})")
            work.read(n)
            header = json.loads(f.read(n))
    except (OSError, ValueError, RecursionError) as exc:
        raise Incomplete(f"{path.name} unreadable: {exc}") from None
    end = _safetensors_end(path, header)
    if size < 8 + n + end:
        raise Incomplete(f"{path.name} truncated: {path.stat().st_size} bytes, header needs {8 + n + end}")


def _safetensors_end(path: Path, header: Any) -> int:
    if not isinstance(header, dict):
        raise Incomplete(f"{path.name} header is not a JSON object")
    end = 0
    for k, v in header.items():
        if k == "__metadata__":
            continue
        offsets = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)):
            raise Incomplete(f"{path.name} header: tensor {str(k)[:64]!r} has no valid data_offsets")
        end = max(end, offsets[1])
    return end


def _read_json(path: Path, work: Work) -> Any:
    """A small JSON file, size charged before reading; deep nesting is an unreadable file, not a crash."""
    work.guard(path)
    work.read(path.stat().st_size)
    try:
        return json.loads(path.read_text())
    except (ValueError, RecursionError) as exc:
        raise Incomplete(f"{path.name} unreadable: {type(exc).__name__}: {str(exc)[:200]}") from None


# -- the four layouts -------------------------------------------------------------------------------


def _deepspeed(tag_dir: Path, work: Work) -> None:
    models = work.listdir(tag_dir, "*mp_rank_*_model_states.pt")
    if not models:
        raise Incomplete("no mp_rank_*_model_states.pt")
    for m in models:
        check_torch_file(m, work)
    optim = work.listdir(tag_dir, "*zero_pp_rank_*_optim_states.pt")
    ranks = sorted({int(hit.group(1)) for o in optim if (hit := re.search(r"zero_pp_rank_(\d+)_", o.name))})
    if ranks and ranks != list(range(ranks[-1] + 1)):
        missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
        raise Incomplete(f"optimizer states of rank(s) {missing} missing")
    for o in optim:
        check_torch_file(o, work)


def _megatron(it_dir: Path, work: Work) -> None:
    if (it_dir / ".metadata").exists() or (it_dir / "metadata.json").exists():
        check_dcp(it_dir, work)
        return
    ranks = [d for d in work.listdir(it_dir, "mp_rank_*") if d.is_dir()]
    if not ranks:
        raise Incomplete("no mp_rank_* directories")
    for d in ranks:
        work.guard(d)
        files = work.listdir(d, "*.pt")
        if not files:
            raise Incomplete(f"{d.name} holds no model_optim_rng.pt")
        for f in files:
            check_torch_file(f, work)


def _huggingface(ck: Path, work: Work) -> None:
    state = ck / "trainer_state.json"
    if not state.is_file():
        raise Incomplete("trainer_state.json missing")
    _read_json(state, work)
    names = work.listdir(ck)
    index = next((p for p in names if p.name.endswith(".safetensors.index.json")), None)
    if index is not None:
        weight_map = _read_json(index, work)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise Incomplete(f"{index.name} unreadable: no weight_map of file names")
        for s in sorted(set(weight_map.values())):
            if not (ck / s).is_file():
                raise Incomplete(f"weight shard {s} missing")
            check_safetensors(ck / s, work)
        return
    single = [p for p in names if p.name.endswith(".safetensors")]
    for s in single:
        check_safetensors(s, work)
    bins = [p for p in names if p.match("pytorch_model*.bin")]
    for b in bins:
        check_torch_file(b, work)
    if not single and not bins and not (ck / ".metadata").exists():
        raise Incomplete("no model weights")
    if (ck / ".metadata").exists():
        check_dcp(ck, work)


def _candidates(root: Path, work: Work) -> Iterator[tuple[CheckpointFormat, Path, int]]:
    """Every checkpoint directory under root, with its format and step (symlinks out of root are passed over)."""
    entries = work.listdir(root)
    dirs = [d for d in entries if work.inside(d) and d.is_dir()]
    if (root / "latest").is_file() or any(d.name.startswith("global_step") for d in dirs):
        for d in dirs:
            if d.name.startswith("global_step") and (s := _step_of(d.name)) is not None:
                yield CheckpointFormat.DEEPSPEED, d, s
    if (root / "latest_checkpointed_iteration.txt").is_file() or any(d.name.startswith("iter_") for d in dirs):
        for d in dirs:
            if d.name.startswith("iter_") and (s := _step_of(d.name)) is not None:
                yield CheckpointFormat.MEGATRON, d, s
    for d in dirs:
        if d.name.startswith("checkpoint-") and (s := _step_of(d.name)) is not None:
            yield CheckpointFormat.HF, d, s
    for d in dirs:
        if d.name.startswith(("global_step", "iter_", "checkpoint-")):
            continue
        if (d / ".metadata").exists() or work.listdir(d, "*.distcp"):
            yield CheckpointFormat.DCP, d, _step_of(d.name) or 0
    if (root / ".metadata").exists():
        yield CheckpointFormat.DCP, root, _step_of(root.name) or 0


_CHECKS: dict[CheckpointFormat, Callable[[Path, Work], None]] = {
    CheckpointFormat.DCP: check_dcp, CheckpointFormat.DEEPSPEED: _deepspeed,
    CheckpointFormat.MEGATRON: _megatron, CheckpointFormat.HF: _huggingface,
}


def allowed(root: Path, roots: Sequence[str | os.PathLike[str]]) -> str | None:
    """Why `root` may not be searched (outside every allowed root, symlinks resolved), or None."""
    real = os.path.realpath(root)
    if not roots:
        return (f"checkpoint path {root} refused: no allowed roots are configured (set KMEND_CHECKPOINT_ROOTS "
                "to the directories checkpoints live under)")
    if any(_under(real, os.path.realpath(r)) for r in roots):
        return None
    return f"checkpoint path {root} (really {real}) is outside the allowed roots {[str(r) for r in roots]}"


def discover(root: Path, *, roots: Sequence[str | os.PathLike[str]] | None = None, limits: Limits | None = None,
             clock: Callable[[], float] = time.monotonic) -> Discovery:
    """The newest complete checkpoint under `root`, and the newer ones that were skipped and why.

    With `roots`, `root` must lie under one of them (after resolving symlinks). Nothing a
    symlink takes out of `root` is read, and the search stops within `limits`.
    """
    if roots is not None and (why := allowed(root, roots)) is not None:
        return Discovery(None, ((str(root), why),))
    if not root.is_dir():
        return Discovery(None, ((str(root), "checkpoint path does not exist"),))
    # Object-store prefixes (UPath) have no symbolic links to leave by; only local paths get a boundary.
    local = isinstance(root, PurePath)
    work = Work(limits, boundary=os.path.realpath(root) if local else None, clock=clock)
    skipped: list[tuple[str, str]] = []
    try:
        found = sorted(_candidates(root, work), key=lambda c: (c[2], c[1].stat().st_mtime), reverse=True)
        for fmt, path, step in found:
            try:
                _CHECKS[fmt](path, work)
            except Incomplete as exc:
                skipped.append((str(path), str(exc)))
                continue
            except OSError as exc:
                skipped.append((str(path), f"unreadable: {exc}"))
                continue
            return Discovery(Checkpoint(fmt, str(path), step), tuple(skipped),
                             tuple(sorted({f for f, _, _ in found})))
    except OverBudget as exc:
        skipped.append((str(root), f"search stopped: {exc}"))
        return Discovery(None, tuple(skipped))
    except OSError as exc:
        skipped.append((str(root), f"unreadable: {exc}"))
        return Discovery(None, tuple(skipped))
    return Discovery(None, tuple(skipped), tuple(sorted({f for f, _, _ in found})))
