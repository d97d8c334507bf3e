"""Everything the store creates under ``CGSTORE_HOME`` is private to the service user.

Directories 0700, files 0600, set explicitly at creation (whatever the umask):
the blobs, staged uploads, the SQLite database and the signing key are nobody
else's to read. ``cgstore`` commands also run with umask 077, which covers files
that libraries create on the store's behalf (lock files, SQLite's -wal/-shm).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
UMASK = 0o077


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) 0700; an existing directory is left as its owner set it."""
    path = Path(path)
    if not path.is_dir():
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=DIR_MODE)
            # mkdir's mode passes through the umask, which may be stricter, never wider: say it exactly.
            os.chmod(path, DIR_MODE)
    return path


def private_file(path: Path) -> None:
    """Create ``path`` empty and 0600 unless it exists (so the program that fills it inherits the mode)."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
