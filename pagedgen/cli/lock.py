"""One run per output at a time: an exclusive, non-blocking ``fcntl.flock`` on ``OUTPUT.pagedgen.lock``
(``out.jsonl`` -> ``out.pagedgen.lock``, beside the sidecar), taken before the output, its sidecar or
its errors file is read or written and held until the run ends.

Two runs appending to one output would break exactly-once (each writes rows the other also writes,
and they race on the sidecar's temporary file); the second is refused at once instead. The lock is
the kernel's: it is released when the process ends in any way (an exception, a signal, ``kill -9``),
so a stale lock file never blocks a rerun. The file holds the pid and output of the run holding it
(for the message). Outputs named with and without ``.jsonl``, which share a sidecar, share the lock too.

The run removes the file when it ends (normally or refused), *while it still holds the lock*, and a
run that takes the lock checks that the path still names the file it locked (same device and
inode), else it tries again on the new file. Without that check, deleting the file would let two
runs hold locks at once: B opens the file and waits for the flock while A deletes and releases it;
B then locks the deleted file and C locks a new one at the same path. A run killed with ``kill -9``
leaves its file behind; the next run takes it over.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from pagedgen.cli.errors import CLIError
from pagedgen.cli.sidecar import paths_for


def lock_path(output: str) -> str:
    """``out.jsonl`` -> ``out.pagedgen.lock`` (named like the sidecar, see ``sidecar.paths_for``)."""
    return paths_for(output)[0].removesuffix(".json") + ".lock"


class OutputLock:
    """A context manager holding the lock of ``output`` while it is active.

    Raises (on enter):
        CLIError: another process holds the lock (the message names the output and that run's pid),
            or the lock file cannot be created.
    """

    def __init__(self, output: str) -> None:
        self.output = output
        self.path = lock_path(output)
        self._fd: Optional[int] = None

    def __enter__(self) -> "OutputLock":
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not a POSIX system: no lock
            return self
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise CLIError(f"cannot write --output {self.output!r}: cannot create its lock file {self.path!r}: "
                               f"{exc.strerror or exc}") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _holder(fd)
                os.close(fd)
                raise CLIError(f"--output {self.output!r}: another pagedgen run{holder} is writing it (lock {self.path!r}); "
                               f"wait for it to finish, or choose another output") from None
            if _names(self.path, fd):
                break
            os.close(fd)  # the run that held it removed the file meanwhile: lock the one at the path now
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps({"pid": os.getpid(), "output": os.path.basename(self.output)}) + "\n").encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            try:
                os.unlink(self.path)  # still held: no other run can have locked this file or made a new one
            except OSError:
                pass
            os.close(self._fd)  # releases the flock
            self._fd = None


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` is (still) the file open as ``fd``."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _holder(fd: int) -> str:
    """`` (pid N, --output NAME)`` of the run holding the lock, from its file (empty if unreadable)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f" (pid {int(data['pid'])}, --output {data['output']!r})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""
