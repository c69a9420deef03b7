"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

import os
import tempfile
from pathlib import Path

UMASK = os.umask(0)
os.umask(UMASK)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace path with text (its permissions kept; a new file gets the umask's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, path.stat().st_mode if path.exists() else 0o666 & ~UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
