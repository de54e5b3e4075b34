"""The command line's flags: input/output and resume flags here; the LLM's (``EngineArgs``) and
every SamplingParams field's generated from their dataclasses (``pagedgen.engine_args``,
``pagedgen.sampling_args``). See docs/cli.md."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys

from pagedgen.cli import lora, structured
from pagedgen.cli.errors import EXIT_USAGE
from pagedgen.cli.readers import FORMATS
from pagedgen.engine_args import EngineArgs
from pagedgen.sampling_args import add_sampling_args
from pagedgen.sampling_params import SamplingParams

DESCRIPTION = """\
Generate completions for every row of a data set, resumably: rows are appended to --output as they
finish (flushed and fsynced in small batches), and rerunning the same command after an interruption
(Ctrl-C, SIGTERM, kill -9, a power loss) skips the rows already written and finishes the rest, so
that the output holds every input row exactly once. See docs/cli.md.

  pagedgen --model ../shared/models/stories260K --input prompts.jsonl --output out.jsonl --max-tokens 64
"""

#: --task -> the output field holding each row's result (unless --output-field names another)
OUTPUT_FIELDS = {"generate": "completions", "embed": "embedding", "classify": "classification", "reward": "reward", "score": "score"}

#: True when SamplingParams carries truncate_prompt_tokens itself (then its generated flag is used)
ENGINE_TRUNCATES = "truncate_prompt_tokens" in {f.name for f in dataclasses.fields(SamplingParams)}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``pagedgen: error:`` line (exit code 2), and a flag is never
    abbreviated: argparse would take ``--max-token 10`` as ``--max-tokens`` (a prefix of one flag), so a
    typo would pass unnoticed and a flag added later could change what an old command means. An unknown
    flag is an error naming the closest real one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def parse_args(self, args=None, namespace=None):
        ns, rest = self.parse_known_args(args, namespace)
        if rest:
            self.error(unknown_arguments_message(rest, list(self._option_string_actions)))
        return ns

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        if getattr(ns, "output_field", "") is None:  # the task's own field name unless given
            ns.output_field = OUTPUT_FIELDS[ns.task]
        if hasattr(ns, "task"):  # --task score reads two texts: text_1 and text_2 unless named
            if ns.task != "score" and ns.pair_field is not None:
                self.error(f"--pair-field names the second text of --task score; this run's task is {ns.task}")
            if ns.task == "score" and ns.messages_field is not None:
                self.error("--task score reads two texts (--prompt-field, --pair-field), not --messages-field")
            if ns.prompt_field is None:
                ns.prompt_field = "text_1" if ns.task == "score" else "prompt"
            if ns.task == "score" and ns.pair_field is None:
                ns.pair_field = "text_2"
        why = field_names_problem(ns) or seed_problem(ns)
        if why:
            self.error(why)
        return ns, rest


def unknown_arguments_message(rest: list, flags: list) -> str:
    """The error for the arguments ``rest`` that no flag took: each unknown flag with the closest of
    ``flags`` (difflib's ratio >= 0.6), e.g. "unrecognized argument --max-token (did you mean
    --max-tokens?)"."""
    unknown = [tok for tok in rest if tok.startswith("-") and len(tok) > 1]
    if not unknown:
        return f"unrecognized arguments: {' '.join(rest)}"
    parts = []
    for tok in unknown:
        name = tok.split("=", 1)[0]
        close = difflib.get_close_matches(name, [f for f in flags if f.startswith("--")], n=1, cutoff=0.6)
        parts.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return f"unrecognized argument{'s' if len(parts) > 1 else ''} {', '.join(parts)}"


def field_names_problem(ns: argparse.Namespace) -> str | None:
    """Why the field names of parsed flags ``ns`` cannot work, else None: an empty name, or an
    output field (index, completions, prompt_logprobs) that is another output field or the input
    field the prompt is read from (every row would be refused)."""
    names = {"--prompt-field": ns.prompt_field, "--messages-field": ns.messages_field, "--pair-field": getattr(ns, "pair_field", None),
             "--index-field": ns.index_field, "--output-field": ns.output_field}
    for flag, name in names.items():
        if name is not None and not name.strip():
            return f"{flag} must be a non-empty field name, got {name!r}"
    source = ("--messages-field", ns.messages_field) if ns.messages_field is not None else ("--prompt-field", ns.prompt_field)
    added = [("--index-field", ns.index_field), ("--output-field", ns.output_field)]
    if getattr(ns, "prompt_logprobs", None) is not None:
        added.append(("--prompt-logprobs", "prompt_logprobs"))
    sources = [source] + ([("--pair-field", ns.pair_field)] if getattr(ns, "pair_field", None) is not None else [])
    for i, (flag, name) in enumerate(added):
        for other_flag, other in added[i + 1:] + sources:
            if name == other:
                return (f"{flag} and {other_flag} name the same field {name!r} (an output row holds both); "
                        f"give them different names")
    return None


def seed_problem(ns: argparse.Namespace) -> str | None:
    """Why ``--seed`` cannot work, else None: -1, which vLLM's API reads as "no seed" and a user of the
    command line reads as "a random seed", while an unseeded row's draws come from the
    ``--engine-seed`` key (not fresh randomness on each run): refused, naming both ways to say what
    was meant."""
    if getattr(ns, "seed", None) == -1:
        return ("--seed -1 is ambiguous: leave --seed out (or --seed none) for unseeded rows, whose draws come from "
                "the --engine-seed key (not fresh randomness on each run: pass another --engine-seed for other draws), "
                "or give a seed >= 0")
    return None


def _at_least(cast, low, what: str):
    """An argparse type: ``cast(text)``, refused below ``low`` with "expected <what>"."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not value >= low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


_positive_int = _at_least(int, 1, "an integer >= 1")
_seconds = _at_least(float, 0.0, "a number of seconds >= 0")


def _truncation(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"expected a number of tokens >= 1, or -1 (max_model_len), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``pagedgen`` argument parser."""
    ap = _Parser(prog="pagedgen", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    io = ap.add_argument_group("input and output")
    io.add_argument("--input", required=True, metavar="PATH", help="the input file, or - for stdin")
    io.add_argument("--output", required=True, metavar="PATH", help="the output JSONL file (appended to; resumed when it exists)")
    io.add_argument("--input-format", choices=("auto",) + FORMATS, default="auto",
                    help="input format (default: from the file name; .jsonl whose first line is an OpenAI batch request: openai)")
    io.add_argument("--prompt-field", "--prompt-column", dest="prompt_field", default=None, metavar="NAME",
                    help="the field (JSON) or column (CSV/TSV/Parquet) holding the prompt: a string, or a list of token ids "
                         "(default: prompt; text_1 with --task score)")
    io.add_argument("--pair-field", "--pair-column", dest="pair_field", default=None, metavar="NAME",
                    help="with --task score: the field holding each row's second text (default: text_2)")
    io.add_argument("--messages-field", default=None, metavar="NAME",
                    help="read a chat conversation ([{role, content}, ...]) from this field instead, rendered with the chat template")
    io.add_argument("--chat-template", default=None, metavar="FILE",
                    help="a Jinja chat template file (or the template itself) to use instead of the tokenizer's")
    io.add_argument("--task", choices=tuple(OUTPUT_FIELDS), default="generate",
                    help="generate completions (default), or with a pooling model (docs/pooling.md) write each row's embedding, "
                         "class probabilities, per-token rewards or the score of its two texts (a cross-encoder, or the cosine of two embeddings)")
    io.add_argument("--output-field", default=None, metavar="NAME",
                    help="the output field holding the result (default: completions; embedding, classification, reward, score with --task)")
    io.add_argument("--index-field", default="index", metavar="NAME", help="the output field holding the 0-based input row (default: index)")
    io.add_argument("--served-model-name", default=None, metavar="NAME",
                    help="the model name in OpenAI batch responses whose request names none (default: the --model folder's name)")
    if not ENGINE_TRUNCATES:
        io.add_argument("--truncate-prompt-tokens", type=_truncation, default=None, metavar="N",
                        help="keep only the last N tokens of a longer prompt (-1: max_model_len) instead of reporting it as a bad row")
    run = ap.add_argument_group("resume, errors and progress")
    run.add_argument("--unordered", action="store_true", help="write rows as they finish instead of in input order")
    run.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                     help="a malformed or invalid row: stop there (default), or write it to OUTPUT.errors.jsonl and go on")
    run.add_argument("--overwrite", action="store_true", help="start the output again instead of resuming it")
    run.add_argument("--max-in-flight", type=_positive_int, default=None, metavar="N",
                     help="most rows queued or running in the engine at once (default: 2 * max_num_seqs)")
    run.add_argument("--reorder-buffer", type=_positive_int, default=8192, metavar="N",
                     help="most finished rows held back waiting for an earlier row, in input order (default: 8192)")
    run.add_argument("--flush-rows", type=_positive_int, default=1000, metavar="N", help="write and fsync when this many rows wait (default: 1000)")
    run.add_argument("--flush-seconds", type=_seconds, default=1.0, metavar="S", help="... or this long after the last write (default: 1)")
    run.add_argument("--drain-seconds", type=_seconds, default=10.0, metavar="S",
                     help="on SIGINT/SIGTERM, let running rows finish for up to S seconds before stopping (default: 10; a second signal stops at once)")
    run.add_argument("--no-tqdm", action="store_true", help="no progress bar")
    run.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    EngineArgs.add_cli_args(ap)
    ap.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                    help="same as --no-enable-prefix-caching (kept for compatibility)")
    add_sampling_args(ap)
    structured.add_args(ap)
    lora.add_args(ap)
    return ap
