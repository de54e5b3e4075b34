"""EngineArgs and the SamplingParams flags: generated from one description, so that the command line,
dicts (Ray actor kwargs, lm_eval model_args) and ``LLM(...)`` cannot drift apart."""
import argparse
import dataclasses
import inspect
import typing

import pytest

from pagedgen import LLM, SamplingParams, arg_utils
from pagedgen.engine_args import EngineArgs
from pagedgen.sampling_args import add_sampling_args, sampling_params_from_args, sampling_params_from_dict


def _llm_keyword_params():
    sig = inspect.signature(LLM.__init__, eval_str=True)
    return [p for p in sig.parameters.values() if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def test_fields_are_llm_keyword_arguments():
    params = _llm_keyword_params()
    fields = dataclasses.fields(EngineArgs)
    assert [f.name for f in fields] == [p.name for p in params]
    hints = typing.get_type_hints(EngineArgs)
    for f, p in zip(fields, params):
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert default == p.default, f.name
        assert hints[f.name] == p.annotation, f.name
        assert f.metadata["help"], f"EngineArgs.{f.name} has no help text (document it in LLM's docstring)"


def test_llm_args_are_llm_keyword_arguments():
    """``LLMArgs`` (what ``LLM.__init__`` hands ``engine/build.py``) names every keyword argument of
    ``LLM``, in order: a new argument cannot be left out of the engine's build."""
    from pagedgen.llm_args import LLMArgs

    assert [f.name for f in dataclasses.fields(LLMArgs)] == [p.name for p in _llm_keyword_params()]


def _parser():
    ap = argparse.ArgumentParser(prog="pagedgen")
    EngineArgs.add_cli_args(ap)
    add_sampling_args(ap)
    return ap


def test_flags_defaults_and_values():
    ap = _parser()
    ns = ap.parse_args(["--model", "m"])
    assert EngineArgs.from_cli_args(ns) == EngineArgs(model="m")
    assert sampling_params_from_args(ns) == SamplingParams()
    ns = ap.parse_args([
        "--model", "m", "--max-num-seqs", "8", "--no-enable-prefix-caching", "--kv-cache-memory-bytes", "4GiB",
        "--max-model-len", "none", "--engine-seed", "7", "--dtype", "bfloat16", "--preemption-mode", "swap",
        "--temperature", "0", "--seed", "3", "--stop", "a", "--stop", " b", "--stop-token-ids", "1", "2",
        "--logit-bias", '{"5": -3}', "--max-tokens", "none", "--ignore-eos", "--no-skip-special-tokens",
    ])
    args = EngineArgs.from_cli_args(ns)
    assert (args.max_num_seqs, args.enable_prefix_caching, args.kv_cache_memory_bytes, args.seed) == (8, False, 4 << 30, 7)
    assert (args.dtype, args.preemption_mode, args.max_model_len) == ("bfloat16", "swap", None)
    sp = sampling_params_from_args(ns)
    assert (sp.temperature, sp.seed, sp.stop, sp.stop_token_ids, sp.logit_bias) == (0.0, 3, ["a", " b"], [1, 2], {5: -3.0})
    assert (sp.max_tokens, sp.ignore_eos, sp.skip_special_tokens) == (None, True, False)


def test_every_sampling_field_has_a_documented_flag():
    ap = _parser()
    by_dest = {a.dest: a for a in ap._actions}
    for f in dataclasses.fields(SamplingParams):
        if f.name == "structured_outputs":  # its flags: --json-schema, --regex, --choice, --grammar, --schema-field
            from pagedgen.cli.args import build_parser

            assert {"json_schema", "regex", "choice", "grammar", "schema_field"} <= {a.dest for a in build_parser()._actions}
            continue
        action = by_dest[arg_utils.flag_dest(f)]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        doc = arg_utils.docstring_fields(SamplingParams.__doc__, "Attributes").get(f.name)
        assert doc and action.help.startswith(arg_utils.escape_help(doc)), f"SamplingParams.{f.name} is not documented"
    ap.format_help()  # every help string survives argparse's %-formatting


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "x"], "argument --max-num-seqs: expected an integer, got 'x'"),
    (["--kv-cache-memory-bytes", "lots"], "expected a size in bytes"),
    (["--dtype", "int8"], "invalid choice: 'int8'"),
    (["--logit-bias", "{5: 1}"], "expected JSON"),
])
def test_bad_flag_values(argv, message, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--model", "m", *argv])
    assert message in capsys.readouterr().err


def test_dict_round_trip_and_string_conversion():
    args = EngineArgs(model="m", max_num_seqs=4, enable_prefix_caching=False)
    assert EngineArgs.from_dict(args.to_dict()) == args
    lm_eval_style = {"model": "m", "max_num_seqs": "8", "enable_prefix_caching": "False", "device": "none",
                     "kv_cache_memory_bytes": "512MiB", "gpu_memory_utilization": "0.5", "max_model_len": "None"}
    got = EngineArgs.from_dict(lm_eval_style)
    assert (got.max_num_seqs, got.enable_prefix_caching, got.device, got.kv_cache_memory_bytes) == (8, False, None, 512 << 20)
    assert (got.gpu_memory_utilization, got.max_model_len) == (0.5, None)
    with pytest.raises(ValueError, match=r"unknown EngineArgs key\(s\) 'max_seqs'; allowed: model, tokenizer, dtype"):
        EngineArgs.from_dict({"model": "m", "max_seqs": 3})
    with pytest.raises(ValueError, match=r"EngineArgs.max_num_seqs: expected an integer, got 'eight'"):
        EngineArgs.from_dict({"model": "m", "max_num_seqs": "eight"})
    with pytest.raises(ValueError, match="EngineArgs.enforce_eager: expected true or false"):
        EngineArgs.from_dict({"model": "m", "enforce_eager": "maybe"})
    with pytest.raises(ValueError, match="needs 'model'"):
        EngineArgs.from_dict({"max_num_seqs": 3})
    sp = sampling_params_from_dict({"temperature": "0", "stop_token_ids": "1,2", "max_tokens": "none", "ignore_eos": "true"})
    assert (sp.temperature, sp.stop_token_ids, sp.max_tokens, sp.ignore_eos) == (0.0, [1, 2], None, True)
    with pytest.raises(ValueError, match="unknown SamplingParams key"):
        sampling_params_from_dict({"temp": 0})


def test_create_llm(stories_path):
    llm = EngineArgs.from_dict({"model": stories_path, "max_num_seqs": "4", "num_kv_blocks": "64"}).create_llm()
    assert (llm.scheduler_config.max_num_seqs, llm.cache_config.num_blocks) == (4, 64)


def test_parse_bytes_and_docstring_fields():
    assert [arg_utils.parse_bytes(s) for s in ("1000", "4GiB", "2GB", "1.5KiB", "64k")] == [1000, 4 << 30, 2 * 10**9, 1536, 64000]
    with pytest.raises(ValueError):
        arg_utils.parse_bytes("1.5")
    doc = """Title.

    Args:
        a: first line
            continued.
        b, c: shared text.

    Returns:
        x: not an arg.
    """
    assert arg_utils.docstring_fields(doc, "Args") == {"a": "first line continued.", "b": "shared text.", "c": "shared text."}


def test_docs_name_every_flag():
    """docs/cli.md names every flag of the pagedgen parser."""
    import os

    from pagedgen.cli import build_parser

    from conftest import ROOT

    with open(os.path.join(ROOT, "docs", "cli.md")) as f:
        docs = f.read()
    flags = [s for a in build_parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    missing = [s for s in flags if s not in docs]
    assert not missing, f"docs/cli.md does not mention {missing}"
