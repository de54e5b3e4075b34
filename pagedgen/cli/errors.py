"""The command line's error types: what the user can cause ends as one ``pagedgen: error:`` line.

``CLIError`` is a user error (exit code 2): a missing file, a bad flag value, a broken model folder,
an output that cannot be written, an input that changed since the output was started. ``BadRow`` is
one input row that cannot be run (malformed, failing validation); ``--on-error`` decides whether it
stops the run (then it becomes a CLIError) or goes to the errors file.
"""
from __future__ import annotations

EXIT_USAGE = 2  # user errors, as argparse uses for bad flags
EXIT_INTERNAL = 1  # a bug: the last-resort handler


class CLIError(Exception):
    """A user error: printed as ``pagedgen: error: <message>``, exit code 2."""


class BadRow(Exception):
    """An input row that cannot be generated for.

    Args:
        reason: what is wrong, without the location (``"no field 'prompt' (fields: text, id)"``).
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exception classes that mean the user's input is at fault while loading the model or reading
    files: bad values (ValueError, TypeError; JSON and Unicode decoding errors are ValueErrors),
    missing or unreadable files (OSError), broken safetensors, missing optional packages. A model or
    KV cache too big for the machine is recognised by ``is_out_of_memory``."""
    types: list[type[BaseException]] = [CLIError, ValueError, TypeError, OSError, ImportError]
    try:
        from safetensors import SafetensorError

        types.append(SafetensorError)
    except ImportError:  # pragma: no cover - safetensors is a dependency
        pass
    return tuple(types)  # out of memory at load: is_out_of_memory (main adds what to lower)


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (multi-line messages joined with " / ")."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        text = f"{exc.strerror}: {exc.filename!r}"
    parts = [p.strip() for p in text.splitlines() if p.strip()]
    return " / ".join(parts) if parts else type(exc).__name__


#: the CPU allocator's message for a failed allocation (torch raises a plain RuntimeError on the CPU;
#: on CUDA it is torch.OutOfMemoryError)
_CPU_ALLOC_FAILED = "can't allocate memory"


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a failed memory allocation: ``torch.OutOfMemoryError`` or the CPU allocator's
    RuntimeError (what a KV cache, swap space or model too big for the machine raises)."""
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    return isinstance(exc, (RuntimeError, MemoryError)) and (isinstance(exc, MemoryError) or _CPU_ALLOC_FAILED in str(exc))

