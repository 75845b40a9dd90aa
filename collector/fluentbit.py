"""Fluent Bit as an alternative agent: its YAML config, and its records mapped to signals.

The config tails CRI logs (``cri`` multiline parser, ``kubernetes`` filter),
reads ``kmsg``, keeps only lines the rule packs could match (``grep``) and
posts ``json_lines`` to the service's ``/v1/ingest/fluentbit``. Fluent Bit's
regex engine is Onigmo, so Python-only syntax in rule patterns is rewritten.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from collector.podmeta import job_and_rank
from collector.signal import LogLine, Signal, Source
from collector.sources.cri import TimestampParser

_PY_NAMED = re.compile(r"\(\?P<[A-Za-z_][A-Za-z0-9_]*>")


def onigmo(pattern: str) -> str:
    """A Python ``re`` pattern in Onigmo syntax.

    Named groups become non-capturing: ``grep`` only needs a match, and the
    same name in several packs would be a duplicate group in one alternation.
    """
    return _PY_NAMED.sub("(?:", pattern)


def alternation(patterns: Iterable[str]) -> str:
    """One Onigmo regex matching any of the patterns."""
    return "|".join(f"(?:{onigmo(p)})" for p in patterns)


@dataclass(frozen=True, slots=True)
class FluentBitOptions:
    """What the rendered config points at."""

    service_host: str = "kmend.kmend-system.svc"
    """Host of the kmend service."""
    service_port: int = 8080
    """Its port."""
    tls: bool = False
    """Use HTTPS to the service."""
    token_env: str | None = "KMEND_TOKEN"
    """Environment variable holding the bearer token (``None``: no token)."""
    node_env: str = "NODE_NAME"
    """Environment variable holding the node name (downward API)."""
    containers_path: str = "/var/log/containers/*.log"
    """Files the tail input reads (kubelet's symlinks carry pod, namespace and container)."""
    state_dir: str = "/var/lib/fluent-bit"
    """Offsets database and filesystem buffer, on a hostPath so restarts lose nothing."""
    kmsg: bool = True
    """Read the kernel log."""
    retry_limit: int = 20
    """Retries of one flush before Fluent Bit drops it (never unbounded: see render_config)."""


def render_config(
    options: FluentBitOptions, *, container_patterns: Sequence[str], kernel_patterns: Sequence[str]
) -> dict[str, Any]:
    """The Fluent Bit YAML document as a mapping (dump it with :func:`dump_config`)."""
    inputs: list[dict[str, Any]] = [{
        "name": "tail",
        "tag": "kube.*",
        "path": options.containers_path,
        "multiline.parser": "cri",
        "db": f"{options.state_dir}/kube.db",
        "db.locking": True,
        "mem_buf_limit": "50MB",
        "skip_long_lines": False,
        "refresh_interval": 5,
        "storage.type": "filesystem",
    }]
    if options.kmsg:
        inputs.append({"name": "kmsg", "tag": "kmsg", "storage.type": "filesystem"})
    filters: list[dict[str, Any]] = [{
        "name": "kubernetes",
        "match": "kube.*",
        "kube_tag_prefix": "kube.var.log.containers.",
        "merge_log": False,
        "keep_log": True,
        "labels": True,
        "annotations": False,
    }]
    if container_patterns:
        filters.append({"name": "grep", "match": "kube.*",
                        "regex": f"log {alternation(container_patterns)}"})
    if options.kmsg and kernel_patterns:
        filters.append({"name": "grep", "match": "kmsg", "regex": f"msg {alternation(kernel_patterns)}"})
    filters.append({"name": "record_modifier", "match": "*",
                    "record": [f"node ${{{options.node_env}}}"]})
    output: dict[str, Any] = {
        "name": "http",
        "match": "*",
        "host": options.service_host,
        "port": options.service_port,
        "uri": "/v1/ingest/fluentbit",
        "format": "json_lines",
        "json_date_key": "date",
        "json_date_format": "double",
        "compress": "gzip",
        "tls": options.tls,
        # Bounded: Fluent Bit retries a flush on any non-2xx, so a 4xx would otherwise be sent forever.
        # The service answers 2xx for a flush with bad records (it keeps the good ones), so this only
        # ends retries of a body the service can never take; 20 retries with the scheduler's
        # backoff still ride out hours of outage.
        "retry_limit": options.retry_limit,
    }
    if options.token_env:
        output["header"] = [f"Authorization Bearer ${{{options.token_env}}}"]
    return {
        "service": {
            "flush": 1,
            "log_level": "info",
            "http_server": True,
            "http_listen": "0.0.0.0",
            "http_port": 2020,
            "health_check": True,
            "storage.path": f"{options.state_dir}/buffer",
            "storage.sync": "normal",
            "storage.backlog.mem_limit": "16MB",
        },
        "pipeline": {"inputs": inputs, "filters": filters, "outputs": [output]},
    }


def dump_config(doc: Mapping[str, Any]) -> str:
    """YAML text, keys in the order Fluent Bit's documentation uses."""
    return yaml.safe_dump(dict(doc), sort_keys=False, width=1_000_000, default_flow_style=False)


class _Literal(str):
    """A string dumped as a YAML literal block (the config stays readable inside the ConfigMap)."""


class _ConfigMapDumper(yaml.SafeDumper):
    pass


_ConfigMapDumper.add_representer(
    _Literal, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", str(v), style="|"))


def dump_configmap(config_text: str, *, name: str = "kmend-fluent-bit", namespace: str = "kmend-system") -> str:
    """A ConfigMap holding the rendered config as ``fluent-bit.yaml``."""
    doc = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace},
           "data": {"fluent-bit.yaml": _Literal(config_text)}}
    header = "# Rendered by `kmend fluentbit-config --configmap`; re-render after changing the rule packs.\n"
    return header + yaml.dump(doc, Dumper=_ConfigMapDumper, sort_keys=False, width=1_000_000)


# -- records posted by the http output ----------------------------------------------------------------


def _ts(record: Mapping[str, Any], now: float) -> float:
    raw = record.get("date")
    if isinstance(raw, int | float) and raw > 0 and math.isfinite(raw):
        return float(raw)
    parse = TimestampParser()
    for key in ("date", "time"):
        text = record.get(key)
        if isinstance(text, str):
            ts = parse(text)
            if ts is not None:
                return ts
    return now


_RANK = re.compile(r"^\[rank(\d+)\]:")


def record_to_signal(record: Mapping[str, Any], *, default_node: str | None, now: float) -> Signal | None:
    """A Fluent Bit record as a signal; ``None`` when it has no text or no node.

    The id is a hash of node, source, time (to the nanosecond when the CRI
    time field is there), where it came from and the text: Fluent Bit retries
    the same record after a failed POST, and the service drops the repeat.
    """
    k8s = record.get("kubernetes")
    k8s = k8s if isinstance(k8s, Mapping) else {}
    if "msg" in record and ("priority" in record or "sequence" in record):
        source, text = Source.KERNEL, record.get("msg")
    else:
        source = Source.CONTAINER
        text = next((record[k] for k in ("log", "message", "msg") if isinstance(record.get(k), str)), None)
    if not isinstance(text, str) or not text:
        return None
    # Log lines are raw bytes from the node: a NUL in one is content, kept visible, never stored as NUL.
    text = text.rstrip("\n")[:65536].replace("\x00", "\ufffd")
    node = record.get("node") or k8s.get("host") or record.get("hostname") or default_node
    if not isinstance(node, str) or not node or node.startswith("${"):
        node = default_node
    if not node:
        return None
    ts = _ts(record, now)
    identity = "|".join(str(x) for x in (
        node, source.value, record.get("time", record.get("date")), record.get("sequence"),
        k8s.get("pod_id"), k8s.get("container_name"), record.get("stream"), text))
    sid = f"{node}/fluentbit/{hashlib.sha256(identity.encode()).hexdigest()[:32]}"
    if source is Source.KERNEL:
        return Signal(sid, node, source, ts, LogLine(text))
    labels = k8s.get("labels")
    job, rank = job_and_rank(labels) if isinstance(labels, Mapping) else (None, None)
    m = _RANK.match(text)
    if m:
        rank = int(m.group(1))
    return Signal(sid, node, source, ts, LogLine(
        text, k8s.get("namespace_name"), k8s.get("pod_name"), k8s.get("container_name"), job, rank))


MAX_RECORDS = 50_000
"""Records one request may carry (Fluent Bit's own flushes are far smaller)."""

_SPACE = re.compile(r"[ \t\r\n]*")


def parse_payload(body: bytes, *, max_records: int = MAX_RECORDS) -> list[dict[str, Any]]:
    """Records from a ``json_lines`` body (one object per line) or a ``json`` array body.

    Raises ValueError naming the problem: more than `max_records` records (counted while
    parsing, so a huge array is refused without being built), a record that is not an
    object, or JSON nested too deeply to parse.
    """
    stripped = body.strip()
    if not stripped:
        return []
    try:
        return _array(stripped.decode("utf-8"), max_records) if stripped.startswith(b"[") \
            else _lines(stripped, max_records)
    except RecursionError:
        raise ValueError("records: JSON nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"body is not UTF-8: {exc}") from None


def _too_many(max_records: int) -> ValueError:
    return ValueError(f"records: more than {max_records} records in one request (send smaller flushes)")


def _lines(body: bytes, max_records: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for n, line in enumerate(body.split(b"\n"), 1):
        if not line.strip():
            continue
        if len(out) >= max_records:
            raise _too_many(max_records)
        rec = json.loads(line)
        if not isinstance(rec, dict):
            raise ValueError(f"line {n} is not a JSON object")
        out.append(rec)
    return out


def _array(text: str, max_records: int) -> list[dict[str, Any]]:
    """Decode ``[obj, obj, ...]`` one element at a time, so the count is checked before all are built."""
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    pos = _SPACE.match(text, 1).end()  # type: ignore[union-attr]  # matches the empty string at worst
    if text.startswith("]", pos):
        return out
    while True:
        if len(out) >= max_records:
            raise _too_many(max_records)
        rec, pos = decoder.raw_decode(text, pos)
        if not isinstance(rec, dict):
            raise ValueError(f"records[{len(out)}] is not a JSON object (a json body must be an array of objects)")
        out.append(rec)
        pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
        if text.startswith("]", pos):
            if text[pos + 1:].strip():
                raise ValueError("a json body must be one array of objects")
            return out
        if not text.startswith(",", pos):
            raise ValueError(f"records: expected ',' or ']' at character {pos}")
        pos = _SPACE.match(text, pos + 1).end()  # type: ignore[union-attr]
