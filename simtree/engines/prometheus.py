"""Read the Prometheus text exposition format (what vLLM's and SGLang's ``/metrics`` serve).

A page is lines ``name{label="value",...} number [timestamp]`` with ``# HELP`` / ``# TYPE``
comments.  Only samples are kept: ``{(name, labels): value}`` with labels a sorted tuple of
(key, value) pairs.  Escapes in label values (``\\"``, ``\\\\``, ``\\n``) are decoded.
"""
from __future__ import annotations

import re
import urllib.error
import urllib.request
from pathlib import Path

from simtree.errors import SimtreeError

__all__ = ["Sample", "parse_text", "read_source", "FETCH_TIMEOUT_S"]

FETCH_TIMEOUT_S = 10.0
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|(?=}))')
Sample = tuple[str, tuple[tuple[str, str], ...]]


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse_text(text: str, where: str) -> dict[Sample, float]:
    """Samples of a Prometheus text page; a malformed line is a one-line error naming it."""
    samples: dict[Sample, float] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _NAME.match(line)
        if not m:
            raise SimtreeError(f"{where}: line {number} is not a Prometheus sample: {line[:80]!r}")
        name, pos, labels = m.group(0), m.end(), []
        if pos < len(line) and line[pos] == "{":
            pos += 1
            while pos < len(line) and line[pos] != "}":
                lm = _LABEL.match(line, pos)
                if not lm:
                    raise SimtreeError(f"{where}: line {number}: malformed labels: {line[:80]!r}")
                labels.append((lm.group(1), _unescape(lm.group(2))))
                pos = lm.end()
            if pos >= len(line):
                raise SimtreeError(f"{where}: line {number}: unclosed labels: {line[:80]!r}")
            pos += 1
        fields = line[pos:].split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            raise SimtreeError(f"{where}: line {number}: no numeric value: {line[:80]!r}") from None
        samples[(name, tuple(sorted(labels)))] = value   # NaN kept: a counter's reader refuses it
    return samples


def read_source(source: str) -> str:
    """The text of a file, or of an ``http(s)://`` URL (one line naming the URL when it cannot
    be reached)."""
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=FETCH_TIMEOUT_S) as resp:  # noqa: S310 (http(s) only)
                return resp.read().decode("utf-8", errors="replace")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise SimtreeError(f"cannot read {source}: {' '.join(str(reason).split())}") from None
    path = Path(source)
    if path.is_dir():
        raise SimtreeError(f"{source}: a folder (give a metrics file or an http:// URL)")
    if not path.is_file():
        raise SimtreeError(f"{source}: no such file (give a metrics file or an http:// URL)")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SimtreeError(f"{source}: cannot read ({type(exc).__name__})") from None
