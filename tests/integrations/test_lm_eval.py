"""The lm_eval backend ``pagedgen`` against lm_eval's own ``hf`` backend on stories260K (fp32, CPU).

Local tasks (examples/lm_eval_local_tasks.py) over JSONL files cut from TinyStories, loaded through
``TaskManager(include_path=...)``: multiple choice (acc), generate_until (exact_match) and
loglikelihood_rolling (word_perplexity) on stories longer than max_length, so that the rolling
windows fill max_model_len exactly (the case lm-evaluation-harness #2880 is about). Offline: the
datasets library's local json builder; nothing is downloaded.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TINYSTORIES, load_example

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
lm_eval = pytest.importorskip("lm_eval", reason="lm_eval is not installed: pip install -e .[lm_eval] (scripts/setup.sh installs it)")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from pagedgen import SamplingParams  # noqa: E402
from pagedgen.integrations.lm_eval import PagedGenLM  # noqa: E402  (registers "pagedgen")

MAX_LENGTH = 64
TASKS = ["ts_mc", "ts_gen", "ts_roll"]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, stories_path):
    out = str(tmp_path_factory.mktemp("lm_eval_tasks"))
    load_example("lm_eval_local_tasks").write_tasks(out, TINYSTORIES, num_docs=8, num_roll_docs=3, gen_tokens=12)
    return out


def _evaluate(model, model_args, task_dir, tasks=TASKS, **kwargs):
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=tasks, task_manager=TaskManager(include_path=task_dir, include_defaults=False),
        batch_size=1, log_samples=True, bootstrap_iters=0, **kwargs,
    )


@pytest.fixture(scope="module")
def both(task_dir, stories_path):
    args = f"pretrained={stories_path},dtype=float32,max_length={MAX_LENGTH},device=cpu"
    return {model: _evaluate(model, args, task_dir) for model in ("pagedgen", "hf")}


@pytest.fixture(scope="module")
def full_llm(stories_path):
    """An LLM at the model's full length: max_model_len = max_position_embeddings = 512."""
    from pagedgen import LLM

    return LLM(stories_path, dtype="float32", device="cpu")


def test_rolling_documents_are_longer_than_max_length(both, hf_tokenizer):
    docs = [s["doc"]["text"] for s in both["hf"]["samples"]["ts_roll"]]
    lengths = [len(hf_tokenizer(d)["input_ids"]) for d in docs]
    assert len(docs) == 3 and min(lengths) > MAX_LENGTH + 1 and max(lengths) > 3 * MAX_LENGTH, lengths  # several windows each


def test_task_scores_equal_hf(both):
    ours, ref = both["pagedgen"]["results"], both["hf"]["results"]
    assert ours["ts_mc"]["acc,none"] == ref["ts_mc"]["acc,none"]
    assert ours["ts_gen"]["exact_match,none"] == ref["ts_gen"]["exact_match,none"]
    assert ours["ts_roll"]["word_perplexity,none"] == pytest.approx(ref["ts_roll"]["word_perplexity,none"], rel=1e-5)
    assert {t: ours[t]["sample_len"] for t in TASKS} == {"ts_mc": 8, "ts_gen": 8, "ts_roll": 3}


def test_every_loglikelihood_within_1e4_of_hf(both):
    for task in ("ts_mc", "ts_roll"):
        ours, ref = both["pagedgen"]["samples"][task], both["hf"]["samples"][task]
        assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in ref]
        for a, b in zip(ours, ref):
            assert len(a["resps"]) == len(b["resps"])
            for ra, rb in zip(a["resps"], b["resps"]):
                if task == "ts_mc":
                    (ll_a, greedy_a), (ll_b, greedy_b) = ra[0], rb[0]
                    assert greedy_a == greedy_b, (task, a["doc_id"])
                else:
                    ll_a, ll_b = ra[0], rb[0]
                # hf's value is a float32 sum: above 1,024 in magnitude its own resolution (one ulp,
                # 2^-13 ~ 1.2e-4) is coarser than 1e-4, so allow two float32 ulps of it there
                assert abs(ll_a - ll_b) <= max(1e-4, 2.4e-7 * abs(ll_b)), (task, a["doc_id"], ll_a, ll_b)


def test_greedy_generations_identical_to_hf(both):
    ours = [s["resps"] for s in both["pagedgen"]["samples"]["ts_gen"]]
    ref = [s["resps"] for s in both["hf"]["samples"]["ts_gen"]]
    assert ours == ref
    assert sum(bool(r[0][0]) for r in ours) >= 6  # real text, not empty generations


def _hf_logprobs(hf_model, ids):
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)  # [len(ids), vocab]


def test_full_context_at_max_position_embeddings(full_llm, hf_model):
    """Inputs of exactly max_model_len = max_position_embeddings tokens (512), and longer ones cut from
    the left, score as transformers does: the case where vLLM refuses the prompt (#2880)."""
    lm = PagedGenLM(pretrained=full_llm)
    assert lm.max_length == 512
    with open(TINYSTORIES) as f:
        text = " ".join(json.loads(line)["text"] for _, line in zip(range(8), f))
    ids = lm.tok_encode(text)
    assert len(ids) > 600
    requests = [(None, ids[:505], ids[505:513]), (None, ids[:590], ids[590:600]), (None, ids[:400], ids[400:401])]
    got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    for (_, ctx, cont), (ll, greedy) in zip(requests, got):
        window = (ctx + cont)[-513:]
        ref = _hf_logprobs(hf_model, window[:-1])
        rows = ref[len(window) - 1 - len(cont):]
        assert ll == pytest.approx(float(sum(rows[j, t] for j, t in enumerate(cont))), abs=1e-4)
        assert greedy == all(int(rows[j].argmax()) == t for j, t in enumerate(cont))


def test_instance_requests_and_lm_passed_as_object(full_llm, task_dir):
    lm = PagedGenLM(pretrained=full_llm, max_length=MAX_LENGTH)
    res = _evaluate(lm, None, task_dir, tasks=["ts_mc"])
    assert res["results"]["ts_mc"]["sample_len"] == 8
    reqs = [Instance("loglikelihood", {}, ("", " Once upon a time"), 0), Instance("loglikelihood", {}, ("Once upon a", " time"), 1)]
    (empty_ll, _), (ll, _) = lm.loglikelihood(reqs, disable_tqdm=True)
    assert empty_ll < ll < 0  # an empty context is conditioned on the prefix (BOS) token


def test_choices_share_their_context_through_the_prefix_cache(stories_path, hf_model):
    """A multiple-choice question: the choices' prompt logprobs start at their continuation
    (``prompt_logprob_start``), so the context's full blocks are computed once, by the first choice,
    and the others find them in the same step; the scores equal transformers' log-softmax."""
    from pagedgen import LLM

    llm = LLM(stories_path, dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256)
    lm = PagedGenLM(pretrained=llm, max_length=256)  # no left truncation: the windows start alike
    context = " ".join(["Once upon a time, there was a little girl named Lily who liked to play."] * 3)
    choices = [" She went to the park with her mom.", " The dog ran fast.", " It was sunny and warm outside today."]
    reqs = [Instance("loglikelihood", {}, (context, c), i) for i, c in enumerate(choices)]
    scores = lm.loglikelihood(reqs, disable_tqdm=True)
    stats = llm.get_stats()
    assert stats.num_steps == 1 and stats.num_cached_tokens >= 2 * 32  # choices 2 and 3: at least 2 blocks each
    for (ctx, cont), (ll, _) in zip(((r.args[0], r.args[1]) for r in reqs), scores):
        ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
        ids = ctx_ids + cont_ids
        ref = _hf_logprobs(hf_model, ids[:-1])[-len(cont_ids):]
        assert ll == pytest.approx(sum(ref[j, t].item() for j, t in enumerate(cont_ids)), abs=1e-4)


@pytest.mark.parametrize(
    "model_args, error",
    [
        (dict(max_lenght=64), r"unknown pagedgen model_args key\(s\) 'max_lenght'; allowed: pretrained, max_length, .*max_num_seqs"),
        (dict(max_length=64, max_model_len=128), r"max_length=64 and max_model_len=128 differ"),
        (dict(max_num_seqs="many"), r"EngineArgs.max_num_seqs: expected an integer, got 'many'"),
        (dict(max_length="long"), r"model_args max_length: expected an integer, got 'long'"),
    ],
)
def test_bad_model_args_raise_before_loading(stories_path, model_args, error):
    with pytest.raises(ValueError, match=error):
        PagedGenLM(pretrained=stories_path, **model_args)


def test_model_args_map_onto_llm_arguments(stories_path):
    lm = PagedGenLM.create_from_arg_string(
        f"pretrained={stories_path},dtype=float32,max_length=96,block_size=8,num_kv_blocks=64,max_num_seqs=8,"
        "enable_prefix_caching=False,seed=3,batch_size=auto",
        {"device": "cpu"},
    )
    llm = lm.llm
    assert (lm.max_length, llm.scheduler_config.max_model_len, llm.cache_config.block_size, llm.cache_config.num_blocks) == (96, 96, 8, 64)
    assert (llm.scheduler_config.max_num_seqs, llm.cache_config.enable_prefix_caching, llm.seed, str(llm.device)) == (8, False, 3, "cpu")
    assert PagedGenLM(pretrained=llm, max_length=50).max_length == 50
    with pytest.raises(ValueError, match="exceeds the LLM's max_model_len=96"):
        PagedGenLM(pretrained=llm, max_length=200)
    with pytest.raises(ValueError, match=r"cannot change an LLM already built"):
        PagedGenLM(pretrained=llm, max_num_seqs=4)


def test_generate_until_kwargs(full_llm):
    lm = PagedGenLM(pretrained=full_llm, max_length=MAX_LENGTH)
    ctx = "Once upon a time, there was a little girl named Lily."
    greedy, capped, sampled = lm.generate_until([
        Instance("generate_until", {}, (ctx, {"until": ["\n"], "max_gen_toks": 20, "do_sample": False, "temperature": 0.7}), 0),
        Instance("generate_until", {}, (ctx, {"until": ["."], "max_gen_toks": 3}), 1),
        Instance("generate_until", {}, (ctx, {"until": ["."], "max_gen_toks": 20, "do_sample": True, "temperature": 1.5, "seed": 5}), 2),
    ], disable_tqdm=True)
    expected = full_llm.generate([lm.tok_encode(ctx)], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert greedy == lm.tok_decode(expected.outputs[0].token_ids).split("\n")[0]  # do_sample=False wins over temperature
    assert len(lm.tok_encode(capped, add_special_tokens=False)) <= 4 and "." not in capped
    assert "." not in sampled
    for kwargs, error in (
        ({"until": ["."], "max_gen_toks": MAX_LENGTH}, r"max_gen_toks must be in \[1, 63\]"),
        ({"until": ["."], "max_gen_toks": 8, "beam_size": 2}, r"generate_until request 0: unknown gen_kwargs key\(s\) 'beam_size'; allowed: n, "),
        ({"until": ["."], "max_gen_toks": 8, "num_beams": 4}, r"num_beams must be 1"),
        ({"until": ["."], "max_gen_toks": 8, "top_p": 0.0, "do_sample": True, "temperature": 1.0}, r"top_p must be in \(0, 1\]"),
        ({"until": ["."]}, r"max_gen_toks must be in \[1, 63\] \(below max_length\), got 256"),  # hf's default 256
    ):
        with pytest.raises(ValueError, match=error):
            lm.generate_until([Instance("generate_until", {}, (ctx, kwargs), 0)], disable_tqdm=True)


CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"


def test_chat_template(full_llm, task_dir):
    plain = PagedGenLM(pretrained=full_llm, max_length=MAX_LENGTH)
    with pytest.raises(ValueError, match="the tokenizer has no chat template: pass model_args chat_template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])
    lm = PagedGenLM(pretrained=full_llm, max_length=MAX_LENGTH, chat_template=CHAT_TEMPLATE)
    history = [{"role": "system", "content": "Tell stories."}, {"role": "user", "content": "Once upon a time"}]
    assert lm.apply_chat_template(history) == "[system] Tell stories.\n[user] Once upon a time\n[assistant]"
    assert lm.chat_template(True) == CHAT_TEMPLATE
    res = _evaluate(lm, None, task_dir, tasks=["ts_gen"], apply_chat_template=True, limit=2)
    contexts = [s["arguments"][0][0] for s in res["samples"]["ts_gen"]]
    assert len(contexts) == 2 and all(c.startswith("[user] ") and c.endswith("[assistant]") for c in contexts)


def test_cli_runs_a_task_end_to_end(stories_path, task_dir, tmp_path, both):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    cmd = [
        sys.executable, "-m", "pagedgen.integrations.lm_eval", "--model", "pagedgen",
        "--model_args", f"pretrained={stories_path},dtype=float32,max_length={MAX_LENGTH}",  # no --device: this machine's
        "--include_path", task_dir, "--tasks", "ts_mc", "--output_path", str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pagedgen" in proc.stdout and "ts_mc" in proc.stdout and "acc" in proc.stdout
    (result_file,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files if f.startswith("results")]
    with open(result_file) as f:
        acc = json.load(f)["results"]["ts_mc"]["acc,none"]
    assert acc == both["hf"]["results"]["ts_mc"]["acc,none"]


def test_cli_device_default():
    from pagedgen.integrations.lm_eval.__main__ import with_default_device

    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert with_default_device(["--model", "pagedgen", "--tasks", "t"]) == ["--model", "pagedgen", "--tasks", "t", "--device", here]
    for given in (["--device", "cpu"], ["--device=cuda:1"], ["--model_args", "pretrained=x,device=cpu"], ["--model_args=pretrained=x, device=cpu"]):
        assert with_default_device(given) == given
