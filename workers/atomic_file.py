"""Writing a file that readers see whole or not at all: the shard Parquet files and
`export`'s output.

The contents go to a fresh temporary file in the target's own folder (mkstemp: a unique
name created exclusively, so no symlink is followed and two writers never share one), are
fsynced, and then replace the target in one rename; the folder is fsynced so the rename
survives a crash too. The name starts with a dot, which dataset readers skip.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

# The permissions `open` would give a new file (mkstemp's own are 0600), read once: os.umask
# can only be read by setting it.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


@contextmanager
def replacing(path: Path, mode: str = "wb", **open_args: Any) -> Iterator[IO[Any]]:
    """A file open for writing whose contents replace `path` when the block ends; if the
    block raises, `path` is left as it was and the temporary file is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **open_args) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp_name, 0o666 & ~_UMASK)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
