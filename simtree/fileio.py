"""Reading user-supplied YAML/JSON files with one-line errors (never a parser traceback)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from simtree.errors import SimtreeError


def _read(path: str | Path, what: str, fmt: str, parse):
    path = Path(path)
    try:
        return parse(path.read_text())
    except FileNotFoundError:
        raise SimtreeError(f"{what} file not found: {path}") from None
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise SimtreeError(f"{path.name}: not valid {fmt} ({str(exc).splitlines()[0]})") from None


def read_yaml(path: str | Path, what: str):
    """``yaml.safe_load`` of ``path`` (nothing else is ever loaded); ``what`` names its role."""
    return _read(path, what, "YAML", yaml.safe_load)


def read_json(path: str | Path, what: str):
    return _read(path, what, "JSON", json.loads)
