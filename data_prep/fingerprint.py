"""Data sources identified by content: resolved path, size, mtime and sha256.

The tokenize stage records, per source of the recipe, :func:`fingerprint` in ``spec.json``
(:func:`~draftsmith.data_prep.agreement.tokenize_keys`). Before anything is written,
:func:`~draftsmith.data_prep.agreement.disagreements` compares the sources on disk with it:

- the same file named by another path (relative / absolute, a symlink) is the same source;
- a file whose size and mtime are those recorded is taken as unchanged without reading it (the
  recorded sha256 is the cache: a 100 GB source is hashed once, when it is first tokenised);
- otherwise it is hashed (once per process, :data:`_memo`), and a different sha256 is a changed
  source: one line naming the file and what changed, nothing written.

Hub datasets and ``builtin:`` sets have no file to hash here: their fingerprint is ``None`` and
they are compared by id (``datasets`` keeps its own cache fingerprints).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

CHUNK = 1 << 20
_memo: dict[tuple[str, int, int], str] = {}  # (resolved path, size, mtime_ns) -> sha256


def local_file(path: str) -> Path | None:
    """The local file a source path names (resolved), or None for a hub id, ``builtin:`` set or
    missing file."""
    if path.startswith("builtin:"):
        return None
    p = Path(path).expanduser()
    return p.resolve() if p.is_file() else None


def sha256_file(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB chunks (memoised per ``(path, size, mtime)``)."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _memo:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
        _memo[key] = h.hexdigest()
    return _memo[key]


def fingerprint(path: str, recorded: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """``{"path", "size", "mtime_ns", "sha256"}`` of the local file ``path`` names (None for a hub
    dataset / builtin set). With ``recorded`` (an earlier fingerprint of the same file) whose size
    and mtime match, its sha256 is reused without reading the file."""
    f = local_file(path)
    if f is None:
        return None
    st = f.stat()
    if recorded and recorded.get("path") == str(f) and recorded.get("size") == st.st_size \
            and recorded.get("mtime_ns") == st.st_mtime_ns and recorded.get("sha256"):
        digest = recorded["sha256"]
    else:
        digest = sha256_file(f)
    return {"path": str(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}


def normalised_source(source: dict[str, Any]) -> dict[str, Any]:
    """A ``data.sources`` entry with a local file's path resolved (so ``chats.jsonl`` and
    ``/abs/chats.jsonl`` compare equal)."""
    f = local_file(str(source.get("path", "")))
    return dict(source, path=str(f)) if f is not None else dict(source)


def describe_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What changed between two fingerprints of one file, in words."""
    parts = []
    if old.get("size") != new.get("size"):
        parts.append(f"size {old.get('size')} -> {new.get('size')} bytes")
    parts.append(f"sha256 {str(old.get('sha256'))[:12]}… -> {str(new.get('sha256'))[:12]}…")
    return ", ".join(parts)
