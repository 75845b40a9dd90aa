"""Which job and rank a log line belongs to: one answer for the live agent and offline analysis.

The job comes from the pod's labels when they are known (in-cluster API or a labels
file), else from the pod name (``llama-pretrain-worker-3`` is job ``llama-pretrain``).
The rank comes, most specific first, from the line's own prefix (one pod may run eight
ranks that all write to its stdout), from the pod's labels, then from the pod name's
ordinal. The node agent and ``kmend analyze`` both call these functions, so the same
files give the same job, rank and node either way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from collector.podmeta import job_and_rank

_POD_JOB = re.compile(r"^(?P<job>.+?)-(?:(?:worker|master|launcher|chief|ps|evaluator|trainer)-)?(?P<ord>\d+)$")

# Prefixes launchers put in front of each rank's output, at the start of the message:
# torchrun's ``--tee``/``--local-ranks-filter`` form ``[rank3]:``, its older role form
# ``[default3]:`` and Slurm's ``srun --label`` form ``3: ``.
_LEADING_RANK = re.compile(r"^\s*(?:\[(?:rank|default)(?P<a>\d{1,6})\]:|(?P<b>\d{1,6}): )")
# The same prefixes after a timestamp or host name the runtime or a shipper added.
_INNER_RANK = re.compile(r"\[(?:rank|default)(?P<a>\d{1,6})\]:")
# DeepSpeed's ``log_dist`` and the NCCL/gloo watchdog name the rank inside the message.
_NAMED_RANK = re.compile(r"\[(?:Rank|RANK) (?P<a>\d{1,6})\]")
_INNER_SPAN = 96
"""How far into a line a prefix may start (timestamps and host names are shorter)."""


def job_from_pod(pod: str) -> str:
    """Job name from a pod name: ``llama-pretrain-worker-3`` -> ``llama-pretrain``."""
    m = _POD_JOB.match(pod)
    return m.group("job") if m else pod


def rank_from_pod(pod: str) -> int | None:
    """The pod name's ordinal (``bert-worker-5`` -> 5), which is the rank of a one-process pod."""
    m = _POD_JOB.match(pod)
    return int(m.group("ord")) if m else None


def pod_identity(pod: str, labels: Mapping[str, str] | None, *, job: str | None = None,
                 ) -> tuple[str, int | None]:
    """Job and pod-level rank: an explicit job first, then the labels, then the pod name."""
    label_job, label_rank = job_and_rank(labels) if labels else (None, None)
    name = job or label_job or job_from_pod(pod)
    rank = label_rank if label_rank is not None else rank_from_pod(pod)
    return name, rank


def line_rank(text: str) -> int | None:
    """The rank a line's launcher prefix or DeepSpeed/NCCL ``[Rank N]`` tag names, if any."""
    m = _LEADING_RANK.match(text) or _INNER_RANK.search(text, 0, _INNER_SPAN) or _NAMED_RANK.search(text)
    if m is None:
        return None
    return int(m.group("a") if m.group("a") is not None else m.group("b"))


def strip_rank_prefix(text: str) -> str:
    """The message without a leading launcher prefix (``[rank3]:``, ``[default3]:``, ``3: ``)."""
    m = _LEADING_RANK.match(text)
    return text[m.end():] if m else text
