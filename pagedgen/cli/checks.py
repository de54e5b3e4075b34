"""Checks of the command line that need more than argparse: its SamplingParams against the loaded
model (token ids and logprobs against the vocabulary, ``n`` against max_num_seqs), run once
right after the model loads and before any output file is created or any row is read, so that a
bad flag value is one ``pagedgen: error:`` naming the flag instead of a bad row per input row."""
from __future__ import annotations

import re

from pagedgen import arg_utils
from pagedgen.cli.errors import CLIError, one_line
from pagedgen.sampling_args import sampling_fields

_FIELD = re.compile(r"sampling_params\.(\w+)")


def check_params_fit_model(llm, params, model: str) -> None:
    """CLIError naming the flag (``--logprobs must be in [0, 512] (the vocabulary size), got
    100000``) if the command line's SamplingParams ``params`` cannot run on ``llm`` (the engine's
    own check, ``RequestProcessor.check_params``). ``model``: the --model path, for the message."""
    try:
        llm.processor.check_params(params, "sampling_params")
    except (ValueError, TypeError) as exc:
        flags = {f.name: arg_utils.flag_name(f) for f in sampling_fields()}
        flags["structured_outputs"] = "the structured-output flag (--json-schema, --regex, --choice or --grammar)"
        message = _FIELD.sub(lambda m: flags.get(m.group(1), m.group(0)), one_line(exc))
        raise CLIError(f"{message} (a command-line value that does not fit the model {model!r})") from exc
