"""Helpers of the CLI tests (test_cli*.py): run ``pagedgen`` in-process or as a subprocess, read JSONL."""
import json
import os
import subprocess
import sys

from conftest import ROOT


def run_cli(capsys, *argv) -> tuple[int, str]:
    """``pagedgen ARGV --no-tqdm`` in this process: (exit code, stderr)."""
    from pagedgen.cli import main

    capsys.readouterr()
    try:
        rc = main([*map(str, argv), "--no-tqdm"])
    except SystemExit as exc:  # argparse's usage errors
        rc = exc.code
    return rc, capsys.readouterr().err


def popen_cli(*argv, **kwargs) -> subprocess.Popen:
    """``python -m pagedgen ARGV --no-tqdm`` as a subprocess (one torch thread), stderr piped."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "pagedgen", *map(str, argv), "--no-tqdm"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kwargs)


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("pagedgen: error:")]
