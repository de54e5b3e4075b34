"""Commands that run Python in a child process with the checkout NOT first on sys.path, so that a
PYTHONPATH naming an installed wheel decides which pagedgen is imported (``python -c`` and
``python -m`` put the working directory first; ``-P`` would drop it, but only from Python 3.11)."""
import sys

_DROP_CWD = "import sys; sys.path.pop(0); "


def python_c(code: str, *args) -> list:
    """argv of ``python -c code args...`` without the working directory on sys.path."""
    return [sys.executable, "-c", _DROP_CWD + code, *map(str, args)]


def pytest_argv(*args) -> list:
    """argv of ``python -m pytest args...`` without the working directory on sys.path."""
    return python_c("import pytest; sys.exit(pytest.main(sys.argv[1:]))", *args)
