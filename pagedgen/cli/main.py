"""``pagedgen`` / ``python -m pagedgen``: check everything, load the model, resume or start the output,
run, summarise. Every error the user can cause ends as one ``pagedgen: error:`` line and exit code 2
(``--debug`` shows the traceback instead); an interruption prints how to resume."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import signal
import sys
import time
from typing import Iterator, Optional

from pagedgen.cli import checks, openai_batch, readers, resume, sidecar, structured
from pagedgen.cli import lora as cli_lora
from pagedgen.cli import progress as progress_mod
from pagedgen.cli.args import ENGINE_TRUNCATES, build_parser
from pagedgen.cli.errors import EXIT_INTERNAL, EXIT_USAGE, CLIError, is_out_of_memory, one_line, user_error_types
from pagedgen.cli.lock import OutputLock, lock_path
from pagedgen.cli.prompts import MISSING_FIELD, PromptSpec, RequestBuilder
from pagedgen.cli.runner import Outcome, RunSettings, StopSignals, run_rows
from pagedgen.cli.writer import Appender, RowWriter, output_is_input


def main(argv: Optional[list[str]] = None) -> int:
    """Run the command line (``argv`` without the program name; default ``sys.argv[1:]``); returns
    the exit code: 0 done, 2 a user error (one ``pagedgen: error:`` line), 128 + signal number
    after SIGINT/SIGTERM, 1 an internal error."""
    args = build_parser().parse_args(argv)
    try:
        with contextlib.ExitStack() as held:  # the output's lock, released on every way out
            return _run(args, held)
    except CLIError as exc:
        if args.debug:
            raise
        _say(f"error: {one_line(exc)}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        if args.debug:
            raise
        _say("interrupted before any row was generated")
        return 128 + signal.SIGINT
    except Exception as exc:  # last resort: still one line, never a traceback without --debug
        if args.debug:
            raise
        _say(f"error: internal error: {type(exc).__name__}: {one_line(exc)} (run again with --debug to see where)")
        return EXIT_INTERNAL


def _say(text: str) -> None:
    print(f"pagedgen: {text}", file=sys.stderr, flush=True)


class _UserErrors:
    """Turns the exception classes a user can cause (``types``, default ``user_error_types()``) into
    a CLIError whose message starts with ``what``."""

    def __init__(self, what: str = "", types: Optional[tuple] = None) -> None:
        self.what, self.types = what, types

    def __enter__(self) -> "_UserErrors":
        return self

    def __exit__(self, tp, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, CLIError) and isinstance(exc, self.types or user_error_types()):
            raise CLIError(f"{self.what}{one_line(exc)}") from exc
        return False


def _run(args, held: contextlib.ExitStack) -> int:
    from pagedgen.engine_args import EngineArgs
    from pagedgen.sampling_args import sampling_params_from_args

    with _UserErrors(""):
        params = structured.with_constraint(sampling_params_from_args(args), args)
    loras = cli_lora.adapters(args)  # --lora NAME=PATH: turns on enable_lora
    engine_args = EngineArgs.from_cli_args(args)
    fmt = _check_input(args)
    out_sidecar, out_errors = sidecar.paths_for(args.output)
    _check_output(args, (args.output, out_sidecar, out_errors, lock_path(args.output), out_sidecar + ".tmp"))  # .tmp: Sidecar.save's
    held.enter_context(OutputLock(args.output))  # before the output, sidecar or errors file is read
    spec = _prompt_spec(args, fmt)
    with _UserErrors("cannot read --input: "):
        readers.check_header(args.input, fmt, prompt_field=spec.prompt_field, required_column=spec.messages_field or spec.prompt_field)
        if fmt == "openai" and args.input != "-":  # a repeated custom_id, before any work (stdin: when its row comes)
            try:
                openai_batch.check_unique_ids(readers.read_rows(args.input, fmt, prompt_field=spec.prompt_field, required_column=None))
            except CLIError as exc:
                raise CLIError(f"{args.input}: {exc}") from None
    with _UserErrors(""):
        from pagedgen.model import loader

        folders = [args.model] + ([args.tokenizer] if args.tokenizer else [])
        loader.check_model_folder(args.model)
        model_fp = sidecar.model_fingerprint(folders)
        speculative = _speculative_fingerprint(engine_args.speculative_config)
    fingerprint = _params_fingerprint(args, fmt, params, spec)
    if speculative is not None:
        fingerprint["speculative_config"] = speculative
    if loras:
        fingerprint["lora"] = cli_lora.fingerprint(args, loras)
    sidecar.check_owner(args.output, args.overwrite)
    sidecar.check_errors_file_not_shared(args.output)
    state = _existing_state(args, fmt, out_sidecar, out_errors, model_fp, fingerprint)

    try:
        with _UserErrors(""):
            llm = engine_args.create_llm()
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        raise CLIError(f"out of memory while loading the model and allocating the KV cache ({one_line(exc)}): lower "
                       "--kv-cache-memory-bytes, --num-kv-blocks, --swap-space-bytes or --gpu-memory-utilization, "
                       "or pass a smaller --max-model-len") from exc
    pooling = llm.llm_engine.pooling
    if (pooling is None) != (args.task == "generate"):
        raise CLIError(f"--task {args.task}: {args.model} loads as a pooling model ({pooling.architecture}); pass --task embed, classify, "
                       "reward or score" if pooling is not None else f"--task {args.task} needs a pooling model: pass --convert embed "
                       "(or --runner pooling), or a *ForSequenceClassification / BertModel checkpoint (docs/pooling.md)")
    if args.task == "score" and pooling.num_labels > 1:
        raise CLIError(f"--task score needs a cross-encoder (a classification head with one label) or an embedding model; "
                       f"{args.model} ({pooling.architecture}) has {pooling.num_labels} labels: pass --task classify")
    if args.task in ("classify", "reward") and not pooling.num_labels:
        raise CLIError(f"--task {args.task} needs a classification head (a *ForSequenceClassification checkpoint); "
                       f"{args.model} ({pooling.architecture}) embeds only: pass --task embed")
    if spec.mode == "messages" and spec.chat_template is None and not getattr(llm.tokenizer, "chat_template", None):
        raise CLIError("the tokenizer has no chat template: pass one with --chat-template FILE")
    checks.check_params_fit_model(llm, params, args.model)
    cli_lora.check(llm, loras)

    car, done, scans = state
    fresh = args.overwrite or car is None
    if fresh:
        for path in (args.output, out_errors):  # regular files (_check_output); an empty output is kept as it is
            if os.path.exists(path) and (args.overwrite or path != args.output):
                os.remove(path)
        car = sidecar.Sidecar(out_sidecar, {"version": sidecar.SIDECAR_VERSION, "created": int(time.time()),
                                            "output": os.path.basename(args.output),
                                            "input": {"path": os.path.abspath(args.input) if args.input != "-" else "-",
                                                      "format": fmt, "bytes": 0, "rows": 0},
                                            "model": model_fp, "params": fingerprint})
        if fmt == "parquet":
            car.data["input"]["file_sha256"] = sidecar.hash_prefix(args.input)[0]
        scans = []
    car.data["output"] = os.path.basename(args.output)  # an older sidecar has none
    for scan in scans:
        if scan.torn_bytes:
            resume.truncate_to(scan)
            _say(f"repaired {scan.path}: cut {scan.torn_bytes} bytes of an unfinished last line (that row is generated again)")
    made = [out_sidecar] if fresh else []  # what this run creates: removed if it ends without writing a row
    try:
        with _UserErrors(f"cannot write --output {args.output!r}: "):
            car.save()  # first the sidecar, then the output: an output never exists without one
            if not os.path.exists(args.output):
                made.append(args.output)
                open(args.output, "ab").close()
                sidecar.fsync_dir(args.output)
    except BaseException:
        _remove_unwritten(made, args.output, out_errors)
        raise
    # What exists now (model, tokenizer, imported modules: ~200k objects) lives to the end of the run:
    # frozen, Python's full collections skip it. Rows are allocated while others run, so the run
    # triggers full collections, each ~0.2 s over the unfrozen heap (~5% of a 10k-row run on
    # stories260K); vLLM freezes after start-up too. Unfrozen afterwards (main() may run in-process).
    gc.collect()
    gc.freeze()
    rc = None
    try:
        rc = _generate(args, llm, fmt, spec, params, car, done, out_errors, scans[0].rows if scans else 0, loras)
        return rc
    finally:
        gc.unfreeze()
        if rc != 0:  # refused at a bad first row, interrupted, failed: a run that wrote nothing leaves nothing
            _remove_unwritten(made, args.output, out_errors)


def _remove_unwritten(made: list[str], output: str, errors: str) -> None:
    """Remove the files in ``made`` (this run's new sidecar and output) when no row was written: the
    output is empty and there is no errors file. Then they cannot hold the next run to this run's
    flags (a corrected --prompt-field, say). Called while the output's lock is held."""
    if os.path.exists(errors) or (os.path.exists(output) and os.path.getsize(output)):
        return
    for path in made:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _check_input(args) -> str:
    """The input format; CLIError for a missing or unreadable input or bad flag combinations."""
    if args.input != "-":
        with _UserErrors("cannot read --input: "):
            if os.path.isdir(args.input):
                raise IsADirectoryError(21, "Is a directory", args.input)
            open(args.input, "rb").close()
    fmt = args.input_format
    if fmt == "auto":
        with _UserErrors("cannot read --input: "):
            fmt = readers.detect_format(args.input, sys.stdin.buffer if args.input == "-" else None)
    if args.messages_field and fmt in ("text", "csv", "tsv", "openai"):
        raise CLIError(f"--messages-field needs JSON rows (jsonl, json or parquet input), not {fmt}"
                       + (" (OpenAI batch requests carry their own messages)" if fmt == "openai" else ""))
    return fmt


def _check_output(args, paths: tuple[str, ...]) -> None:
    """CLIError if an output path (the output, its sidecar, errors and lock files) is the input, is a
    symbolic link or something else than a regular file, or cannot be written (checked before any
    work: pagedgen never removes or replaces a path that is not a regular file it writes)."""
    out = args.output
    if not out:
        raise CLIError("--output '': give the path of the output file")
    if out == "-":
        raise CLIError("--output -: writing to stdout is not supported (the output must be a file that a rerun can "
                       "resume); give a file path")
    for path in paths:
        why = output_is_input(path, args.input)
        if why:
            raise CLIError(f"--output {out!r}: {path!r} {why}; choose another output")
        what = "--output" if path == out else f"--output {out!r}: {path!r}"
        if os.path.islink(path):
            raise CLIError(f"{what} is a symbolic link (to {os.readlink(path)!r}): pagedgen does not write through "
                           f"links; give the real path of a regular file")
        if os.path.exists(path) and not os.path.isfile(path) and not (path == out and os.path.isdir(path)):
            kind = "a directory" if os.path.isdir(path) else "not a regular file (a device, FIFO or socket)"
            raise CLIError(f"{what} exists and is {kind}; choose another output path")
    folder = os.path.dirname(os.path.abspath(out))
    problem = None
    if os.path.isdir(out):
        problem = "Is a directory"
    elif not os.path.isdir(folder):
        problem = "No such file or directory (the folder does not exist)"
    elif not os.access(folder, os.W_OK) or os.path.exists(out) and not os.access(out, os.W_OK):
        problem = "Permission denied"
    if problem:
        raise CLIError(f"cannot write --output {out!r}: {problem}")


def _prompt_spec(args, fmt: str) -> PromptSpec:
    template = None
    if args.chat_template is not None:
        if os.path.isfile(args.chat_template):
            with _UserErrors("cannot read --chat-template: "):
                with open(args.chat_template, encoding="utf-8") as f:
                    template = f.read()
        elif "{{" in args.chat_template or "{%" in args.chat_template:
            template = args.chat_template
        else:
            raise CLIError(f"--chat-template {args.chat_template!r}: no such file (nor a Jinja template)")
        if not template.strip():
            raise CLIError(f"--chat-template {args.chat_template!r} is empty")
    mode = "openai" if fmt == "openai" else "messages" if args.messages_field else "prompt"
    return PromptSpec(mode=mode, prompt_field=args.prompt_field, messages_field=args.messages_field,
                      index_field=args.index_field, output_field=args.output_field, chat_template=template,
                      truncate_prompt_tokens=None if ENGINE_TRUNCATES else args.truncate_prompt_tokens,
                      schema_field=args.schema_field, compact_json=args.disable_any_whitespace, pair_field=args.pair_field,
                      close_at_max_tokens=args.close_at_max_tokens)


def _params_fingerprint(args, fmt: str, params, spec: PromptSpec) -> dict:
    """Everything that shapes an output row, as JSON (compared with the sidecar's on resume)."""
    values = dataclasses.asdict(params)
    values.update(
        dtype=str(args.dtype), engine_seed=args.engine_seed, max_model_len=args.max_model_len, input_format=fmt,
        prompt_field=spec.prompt_field, messages_field=spec.messages_field, index_field=spec.index_field,
        output_field=spec.output_field, truncate_prompt_tokens=spec.truncate_prompt_tokens, unordered=args.unordered,
        chat_template_sha256=hashlib.sha256(spec.chat_template.encode()).hexdigest() if spec.chat_template else None,
        served_model_name=args.served_model_name, schema_field=spec.schema_field, compact_json=spec.compact_json,
    )
    if params.structured_outputs is not None or spec.schema_field is not None or fmt == "openai":
        # a run that can build a structured request (a row's schema, a body's response_format):
        # True reads as an older sidecar's missing key (sidecar.ADDED_DEFAULTS)
        values.update(close_at_max_tokens=spec.close_at_max_tokens)
    if args.task != "generate":  # (absent for generation: the sidecars written before --task read back the same)
        values.update(task=args.task, pooler_config=args.pooler_config, convert=args.convert)
        if args.task == "score":
            values.update(pair_field=spec.pair_field)
    return json.loads(json.dumps(values))  # as it reads back from the sidecar (dict keys become str)


def _speculative_fingerprint(config) -> Optional[dict]:
    """What of ``--speculative-config`` shapes an output row, for the sidecar, or None. n-gram
    speculation changes no token (greedy and seeded outputs equal speculation off: a performance
    flag); a draft model's sampled tokens come from its draws (docs/speculative.md), so its method,
    k, ``disable_by_batch_size`` and the draft's files bind the output like the model's. The config
    is checked here first (TypeError / ValueError / FileNotFoundError naming the key)."""
    from pagedgen.spec_decode.config import SpeculativeConfig

    if config is None:
        return None
    checked = SpeculativeConfig.from_dict(config)
    if checked.method != "draft_model":
        return None
    return json.loads(json.dumps({"method": checked.method, "num_speculative_tokens": checked.num_speculative_tokens,
                                  "disable_by_batch_size": checked.disable_by_batch_size,
                                  "draft": sidecar.model_fingerprint([checked.model])}))


def _existing_state(args, fmt, out_sidecar, out_errors, model_fp, fingerprint):
    """(sidecar or None, done rows, scans of the output and errors file) of an earlier run."""
    done = resume.DoneSet()
    if args.overwrite or not os.path.exists(args.output):
        return None, done, []
    if os.path.getsize(args.output) == 0 and not os.path.exists(out_errors):
        return None, done, []  # no row written (by any run): nothing to resume, whatever flags started it
    car = sidecar.Sidecar.load(out_sidecar)
    if car is None:
        raise CLIError(f"--output {args.output!r} exists and has no sidecar {out_sidecar!r}, so it was not written by a "
                       f"resumable pagedgen run: pass --overwrite to replace it, or choose another output")
    car.check(model_fp, fingerprint, args.output)
    if args.input != "-":
        with _UserErrors("cannot read --input: "):
            car.check_input_file(args.input, fmt, args.output)
    kind = "openai" if fmt == "openai" else "rows"
    scans = [resume.scan(args.output, kind, done, args.index_field), resume.scan(out_errors, kind, done, args.index_field)]
    if not args.unordered:
        resume.check_in_order(done, scans, kind, args.index_field)
    if done.max_index >= car.input_rows:
        raise CLIError(f"{args.output!r} holds row {done.max_index}, past the {car.input_rows} input rows its sidecar "
                       f"vouches for (the sidecar is stale or was replaced): pass --overwrite to start again")
    return car, done, scans


def _remaining(rows: Iterator, done: resume.DoneSet, tracker: sidecar.InputTracker, stats, expect: Optional[dict]) -> Iterator:
    """The rows not done yet, feeding every row's bytes to ``tracker``. ``expect`` (stdin only):
    the sidecar's input prefix, checked as the rows stream in; rows not done before its end are
    held back until it is verified."""
    held = [] if expect and expect.get("rows") else None
    for row in rows:
        tracker.feed(row.span, row.index + 1)
        if held is not None and tracker.rows >= expect["rows"]:
            if tracker.state() != {k: expect.get(k) for k in ("bytes", "rows", "sha256")}:
                raise CLIError("the input on stdin is not the one the output was started from (its first "
                               f"{expect['rows']} rows differ); pass --overwrite to start again")
            yield from held
            held = None
        if row.index in done:
            stats.already_done += 1
            continue
        if held is not None:
            held.append(row)
        else:
            yield row
    if held is not None:
        raise CLIError(f"the input on stdin has fewer rows ({tracker.rows}) than the output was started from "
                       f"({expect['rows']}); pass --overwrite to start again")


def _generate(args, llm, fmt, spec, params, car, done, out_errors, rows_in_output: int, loras=None) -> int:
    max_in_flight = args.max_in_flight or 2 * llm.scheduler_config.max_num_seqs
    tracker = sidecar.InputTracker(keep_from=car.input_rows, lines=fmt not in ("json", "parquet"))
    stats = progress_mod.RunStats()
    outcome = Outcome()

    def before_write(top_index: int) -> None:
        # the prefix ends with the highest row written, never with the rows read ahead (a bad row among
        # them is not written: fixing it must keep the prefix valid)
        if top_index >= car.input_rows:
            car.update_input(tracker.state_through(top_index))

    writer = RowWriter(Appender(args.output), Appender(out_errors), ordered=not args.unordered, max_buffered=args.reorder_buffer,
                       flush_rows=args.flush_rows, flush_seconds=args.flush_seconds, before_write=before_write)
    builder = RequestBuilder(llm.tokenizer, spec, params, llm.scheduler_config.max_model_len)
    builder.adapters = cli_lora.RowAdapters(loras, args.lora_field) if loras else None
    counter = None
    if args.input != "-" and not args.no_tqdm:
        counter = progress_mod.RowCounter(args.input, fmt)
        counter.start()
    with _UserErrors("cannot read --input: "):
        rows = readers.read_rows(args.input, fmt, prompt_field=spec.prompt_field,
                                 required_column=(spec.messages_field or spec.prompt_field) if fmt in ("csv", "tsv", "parquet") else None)
        remaining = _remaining(rows, done, tracker, stats, car.data["input"] if args.input == "-" else None)
    bar = progress_mod.Progress(not args.no_tqdm, stats, counter)
    settings = RunSettings(on_error=args.on_error, max_in_flight=max_in_flight, drain_seconds=args.drain_seconds,
                           created=car.data["created"], model_name=args.served_model_name or os.path.basename(os.path.normpath(args.model)),
                           task=args.task)
    write_error = f"cannot write --output {args.output!r}: "
    try:
        with StopSignals() as signals, _UserErrors("cannot read --input: ", (OSError,)):
            run_rows(llm, remaining, builder, writer, spec, settings, stats, bar, signals, outcome)
        with _UserErrors(write_error):
            writer.close()
    except BaseException:
        bar.close()
        with _UserErrors(write_error):  # keep what finished (in order) before reporting
            writer.abandon()
            writer.close()
        raise
    bar.close()
    if spec.schema_field is not None and stats.generated and not builder.rows_with_schema:  # a mistyped name is not silent
        _say(f"warning: no row of this run had the field {spec.schema_field!r} named by --schema-field: every row ran "
             "with the command line's constraint (or none)")
    in_output = rows_in_output + writer.rows_written
    _say_summary(stats, llm, args.output, out_errors if writer.errors_written or os.path.exists(out_errors) else None, outcome.completed,
                 in_output > 0)
    total_done = done.count + stats.generated + stats.bad
    kept = f"{in_output:,} {'row is' if in_output == 1 else 'rows are'} in {args.output!r}" if in_output else "no row was written"
    if outcome.bad_row is not None:
        row, reason = outcome.bad_row
        where = "<stdin>" if args.input == "-" else args.input
        unit = "row" if fmt == "parquet" else "line"
        if not in_output and reason.startswith(MISSING_FIELD):
            # likely the command's field name, not the row: --on-error skip would make every row bad and
            # keep a sidecar binding the next run to the wrong name, so it is not suggested
            raise CLIError(f"{where}: {unit} {row.line}: {reason} (stopped there: {kept}; rerun with the field's "
                           f"name corrected, which starts afresh)")
        raise CLIError(f"{where}: {unit} {row.line}: {reason} (stopped there: {kept}; "
                       f"fix the row and rerun the same command to resume, or pass --on-error skip)")
    if outcome.read_error is not None:
        exc = outcome.read_error
        message = one_line(exc) if isinstance(exc, CLIError) else f"cannot read --input: {one_line(exc)}"
        raise CLIError(f"{message} (stopped there: {kept}; rerun the same command to resume once the input is fixed)") from exc
    if outcome.signal is not None:
        name = signal.Signals(outcome.signal).name
        _say(f"interrupted by {name}: {total_done:,} {'row' if total_done == 1 else 'rows'} done ({stats.generated + stats.bad:,} in this run), "
             f"{outcome.aborted_rows:,} unfinished rows dropped; run the same command again to resume")
        return 128 + outcome.signal
    return 0


def _say_summary(stats, llm, output, errors, completed: bool, has_rows: bool) -> None:
    engine_stats = llm.get_stats() if hasattr(llm, "get_stats") else None
    print(progress_mod.summary(stats, engine_stats, output, errors, completed, has_rows), file=sys.stderr, flush=True)
