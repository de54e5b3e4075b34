"""The ``pagedgen`` command line: dataset-scale, resumable, exactly-once generation (docs/cli.md).

    pagedgen --model ../shared/models/stories260K --input prompts.jsonl --output out.jsonl --max-tokens 64

Modules, one job each: ``args`` (flags), ``readers`` + ``json_array`` (input formats, streamed),
``prompts`` (a row -> token ids + SamplingParams), ``openai_batch`` (the OpenAI batch format),
``records`` (output lines), ``writer`` (ordered, durable appends), ``resume`` (what is done, torn
lines), ``sidecar`` (fingerprints of input, model, parameters), ``runner`` (the engine loop),
``progress`` (bar and summary), ``main`` (putting them together, errors as one line).
"""
from pagedgen.cli.args import build_parser
from pagedgen.cli.main import main

__all__ = ["main", "build_parser"]
