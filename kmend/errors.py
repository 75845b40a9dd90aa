"""Configuration mistakes as one line that names the setting, the value and what is expected.

The CLI prints ``kmend: configuration error: …`` and exits 2 for these; tracebacks are for bugs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pydantic import ValidationError

EXIT_CONFIG = 2
"""Exit code of a configuration error (argparse uses 2 for bad flags too)."""


class ConfigError(Exception):
    """A setting is wrong; the message names it, its value and what is expected."""


def env_name(prefix: str, field: str) -> str:
    """``KMEND_HANG_K`` for field ``hang_k``."""
    return f"{prefix}{field}".upper()


def from_validation(exc: ValidationError, *, prefix: str, flags: Mapping[str, str] | None = None) -> ConfigError:
    """A settings ValidationError as one ConfigError naming each bad setting as its environment variable
    (and flag, when the value came from one)."""
    parts = []
    for err in exc.errors(include_url=False):
        field = str(err["loc"][0]) if err["loc"] else ""
        name = env_name(prefix, field)
        if flags and field in flags:
            name += f" ({flags[field]})"
        value = err.get("input")
        shown = "" if isinstance(value, Mapping) else f"={value!r}"
        parts.append(f"{name}{shown}: {err['msg'][0].lower() + err['msg'][1:] if err['msg'] else 'invalid'}")
    return ConfigError("; ".join(parts) or str(exc))


_PASSWORD = re.compile(r"(://[^:/@]+:)[^@]+@")


def redact_url(url: str) -> str:
    """A database URL with its password replaced, safe to print."""
    return _PASSWORD.sub(r"\1***@", url)
