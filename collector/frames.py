"""Where a training process's Python frames are: waiting on its peers, busy with its own work, or elsewhere.

Shared by the node agent (its stack surveys classify each sample) and the service (stack dumps of a
stalled job). A frame is ``func (file:line)`` as ``py-spy`` prints it.
"""

from __future__ import annotations

import re

FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)\s*$")
COLLECTIVE_FILES = ("torch/distributed/", "torch/autograd/", "deepspeed/comm/", "torch/cuda/")
"""Where a rank waits for its peers: c10d collectives, DDP's sync inside backward, DeepSpeed's comm, CUDA sync."""
COLLECTIVE_FUNCS = frozenset({"all_reduce", "allreduce", "barrier", "broadcast", "all_gather", "reduce_scatter",
                              "all_to_all", "backward", "synchronize", "_engine_run_backward", "wait"})

BUSY_PLACES: tuple[tuple[str, str, frozenset[str]], ...] = (
    ("checkpoint", "torch/distributed/checkpoint/",
     frozenset({"save", "async_save", "_save_state_dict", "save_state_dict"})),
    ("checkpoint", "torch/serialization.py", frozenset({"save", "_save", "_legacy_save"})),
    ("checkpoint", "", frozenset({"_save_checkpoint", "save_checkpoint", "save_model"})),
    ("data loader", "torch/utils/data/", frozenset()),
    ("evaluation", "", frozenset({"evaluate", "evaluation_loop", "prediction_loop", "_evaluation_loop", "validate",
                                  "validation_step", "run_evaluation"})),
    ("file I/O", "", frozenset({"read", "readinto", "write", "flush", "fsync", "copyfileobj"})),
)
"""Where a rank that is not waiting on its peers is busy with its own work, and healthy while slow: ``(place,
file part, function names)``; a frame matches when its file contains the part and (if names are given) its
function is one of them. ``torch.save`` (``torch/serialization.py``) and distributed checkpoint's ``dcp.save``
(``torch/distributed/checkpoint/state_dict_saver.py``, which gathers plans over the process group: a rank
inside it is busy saving even while a collective inside it waits); the DataLoader's iterator
(``torch/utils/data/dataloader.py``: ``__next__``, ``_next_data``, ``_get_data``, ``_try_get_data`` waiting on
its workers' queue) and fetchers (``torch/utils/data/_utils/fetch.py``); trainers' evaluation loops
(Hugging Face ``evaluate`` / ``evaluation_loop``, Lightning's ``_evaluation_loop``); file reads and writes.
Checkpoint frames win over a collective below them; any other collective wait wins over the rest."""


def in_collective(frames: list[str]) -> bool:
    """Whether a thread with these frames is waiting on its peers."""
    for fr in frames:
        m = FRAME.match("    " + fr)
        if m is None:
            continue
        func, file = m.group("func"), m.group("file")
        if any(k in file for k in COLLECTIVE_FILES) and (func in COLLECTIVE_FUNCS or "torch/distributed/" in file):
            return True
    return False


def place(frames: list[str]) -> str:
    """Where a main thread is: ``collective`` (waiting on its peers), a `BUSY_PLACES` place, or ``code``."""
    parsed = [(m.group("func"), m.group("file")) for fr in frames if (m := FRAME.match("    " + fr))]
    for func, file in parsed:
        if "torch/distributed/checkpoint/" in file and func in BUSY_PLACES[0][2]:
            return "checkpoint"
    if in_collective(frames):
        return "collective"
    for name, part, funcs in BUSY_PLACES:
        if any(part in file and (not funcs or func in funcs) for func, file in parsed):
            return name
    return "code"
