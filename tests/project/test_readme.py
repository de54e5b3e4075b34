"""What the README states about the code, checked against the code (issue 37): the `LLM(...)`
signature it prints lists every argument with its default, and the command line's defaults it names."""
import inspect
import os
import re

from conftest import ROOT


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_readme_lists_every_llm_argument_with_its_default():
    from pagedgen import LLM

    found = re.search(r"`LLM\(model, \*, (.*?)\)`", _readme(), re.S)
    assert found, "README has no `LLM(model, *, ...)` signature"
    listed = dict(part.strip().split("=", 1) for part in found.group(1).split(","))
    params = [p for p in inspect.signature(LLM.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert list(listed) == [p.name for p in params]
    assert listed == {p.name: f'"{p.default}"' if isinstance(p.default, str) else str(p.default) for p in params}


def test_readme_states_the_cli_defaults_and_the_one_renamed_flag():
    from pagedgen.cli.args import build_parser

    text = " ".join(_readme().split())
    args = build_parser().parse_args(["--model", "m", "--input", "i", "--output", "o"])
    assert args.max_tokens == 16 and "stops after 16 tokens (vLLM's default" in text
    assert args.engine_seed == inspect.signature(__import__("pagedgen").LLM.__init__).parameters["seed"].default
    assert "`seed` is `--engine-seed`" in text and ".pagedgen.json" in text and ".pagedgen.lock" in text
