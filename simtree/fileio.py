"""Reading user files with one-line errors (never a parser traceback); writing files atomically."""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

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
    except UnicodeDecodeError:
        raise SimtreeError(f"{path.name}: not a text file (expected {fmt})") from None
    except IsADirectoryError:
        raise SimtreeError(f"{what} file expected, got a folder: {path}") from None


def read_yaml(path: str | Path, what: str):
    """``yaml.safe_load`` of ``path`` (nothing else is ever loaded); ``what`` names its role."""
    return _read(path, what, "YAML", yaml.safe_load)


def read_json(path: str | Path, what: str):
    return _read(path, what, "JSON", json.loads)


def read_jsonl(path: str | Path, what: str) -> list[tuple[int, object]]:
    """[(line number, parsed object)] of a JSON-lines file's non-blank lines; a missing file, a
    file that is not UTF-8 and a line that is not JSON are one-line errors naming ``what``."""
    path = Path(path)
    if not path.is_file():
        raise SimtreeError(f"{what} {path} does not exist")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise SimtreeError(f"{path}: not a UTF-8 text file (byte {exc.start}: {exc.reason}); "
                           f"a {what} is JSON lines") from None
    out = []
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append((i, json.loads(line)))
            except (json.JSONDecodeError, RecursionError) as exc:
                raise SimtreeError(f"{path}:{i}: not valid JSON ({getattr(exc, 'msg', 'nested too deeply')})") from None
    return out


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of the file's bytes (how bundles, profiles and runs name the file they used)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def archived_by_sha(archive: str | Path, sha: str, member: str | None = None) -> Path | None:
    """The member of the tar ``archive`` (``member``, or any file in it) whose bytes hash to
    ``sha`` (hex, with or without "sha256:"), extracted under the temp folder in a folder named
    after the archive (its name kept); None where the archive or no such member is there.  For
    the committed copies of bundles and profiles that were refitted since, kept in one archive."""
    import tarfile
    want = sha.split(":", 1)[-1]
    archive = Path(archive)
    try:
        with tarfile.open(archive) as tar:
            names = [member] if member else [m.name for m in tar.getmembers() if m.isfile()]
            for name in names:
                f = tar.extractfile(name)
                data = f.read() if f is not None else b""
                digest = hashlib.sha256(data).hexdigest()
                if data and digest == want:
                    out = Path(tempfile.gettempdir()) / "simtree_frozen" / digest[:16] / archive.name / Path(name).name
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(data)
                    return out
    except (OSError, KeyError, tarfile.TarError):
        return None
    return None


def check_out_folder(path: str | Path, what: str = "--out") -> None:
    """A one-line error, before any work, where ``path`` cannot become a folder: it or a folder
    above it is a file (otherwise the command would find out only when it writes, after the work)."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise SimtreeError(f"{what} {path}: {p} is a file, not a folder")
            return


def file_mode_for(path: Path) -> int:
    """The permission bits a file written to ``path`` through a temp file should get: an
    existing file's own; for a new file the usual 0o666 & ~umask (mkstemp alone would leave
    0o600)."""
    if path.exists():
        return path.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomic(path: str | Path, write: Callable[[str], None]) -> Path:
    """Atomic replace: ``write(tmp)`` fills a temp file in the same folder, which is fsynced
    and moved over ``path``; an interruption leaves the previous file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = file_mode_for(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def rewrite_marked_block(path: str | Path, start: str, end: str, text: str, write: bool = True) -> bool:
    """Put ``text`` between the marker lines ``start`` and ``end`` of ``path`` (a generated table
    in a doc); True if it held ``text`` already (then, or with ``write`` False, nothing is written).
    No such markers: a one-line SimtreeError."""
    path = Path(path)
    whole = path.read_text()
    if start not in whole or end not in whole:
        raise SimtreeError(f"{path}: no {start} ... {end} block")
    head, rest = whole.split(start + "\n", 1)
    old, tail = rest.split(end, 1)
    if write and old != text:
        write_text_atomic(path, head + start + "\n" + text + end + tail)
    return old == text


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def write_csv_atomic(path: str | Path, rows: list[dict], columns=None) -> Path:
    """``rows`` as CSV under a header of ``columns`` (default: the first row's keys), lines ended
    by LF as pandas writes them (the csv module's default is CRLF), written atomically."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns if columns is not None else rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return write_text_atomic(path, buf.getvalue())
