"""Speculative decoding with a draft model (issue 34, method "draft_model"): drafts built in the test
from stories260K's own weights (an early-exit draft: its first 4 of 5 layers, embeddings, final
norm and tied head; a random-weight one for the statistical test) and stories260K itself as its own draft.

Greedy outputs equal speculation off token for token (fp32 and bf16, k 1/3/8, prefix caching,
chunked prefill, preemption by recompute and swap inside speculative steps, stop strings and
max_tokens met inside accepted tokens); sampled outputs follow the target's distribution (a
chi-square test against transformers' probabilities, with a deliberately bad draft), depend only on
the request's seed and report the target's logprobs; the refused drafts are ValueErrors."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import GPT2_TOKENIZER, STORIES, story_openings
from scipy.stats import chi2

from pagedgen import LLM, SamplingParams
from pagedgen.spec_decode.early_exit import write_early_exit_draft

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny kernels: threads on a shared CPU only wait


def make_draft(folder, num_layers: int, random_seed=None, config_changes=None, tokenizer_from=STORIES) -> str:
    """stories260K's early-exit draft of its first ``num_layers`` layers (``write_early_exit_draft``:
    embeddings, those layers, final norm, tied head; safetensors). ``random_seed``: every weight
    redrawn instead (a draft far from the target); ``config_changes``: config.json fields changed;
    ``tokenizer_from``: the tokenizer files of that folder instead of stories260K's (None: none)."""
    from safetensors.torch import load_file, save_file

    folder = write_early_exit_draft(STORIES, str(folder), num_layers)
    if config_changes:
        cfg = json.loads(open(os.path.join(folder, "config.json")).read())
        cfg.update(config_changes)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f)
    if random_seed is not None:
        g = torch.Generator().manual_seed(random_seed)
        weights = os.path.join(folder, "model.safetensors")
        redrawn = {name: (torch.ones_like(t) if name.endswith("norm.weight") else torch.randn(t.shape, generator=g) * 0.3)
                   for name, t in load_file(weights).items()}
        save_file(redrawn, weights, metadata={"format": "pt"})
    if tokenizer_from != STORIES:
        for name in os.listdir(folder):
            if name.startswith("tokenizer"):
                os.remove(os.path.join(folder, name))
        for name in os.listdir(tokenizer_from) if tokenizer_from else []:
            if name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
                shutil.copy(os.path.join(tokenizer_from, name), folder)
    return folder


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, stories_path):
    root = tmp_path_factory.mktemp("drafts")
    return {
        "early_exit": make_draft(root / "early_exit", 4),  # 2 layers: ~5% of greedy drafts accepted; 4: ~30%
        "random": make_draft(root / "random", 1, random_seed=3),
        "self": stories_path,
    }


@pytest.fixture(scope="module")
def prompts64(stories_path):
    return story_openings(64)


def _spec(path, k):
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def _run(prompts, params, **kw):
    llm = LLM(STORIES, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.llm_engine.block_manager
    assert bm.num_used_blocks == 0 or bm.enable_prefix_caching, "blocks left held after the call"
    assert not bm.check(), bm.check()
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs], llm.get_stats()


# ----- greedy: outputs equal speculation off ------------------------------------------------------------
@pytest.mark.parametrize("dtype, k, num_prompts, kw", [
    ("float32", 3, 64, dict(block_size=4)),  # prefix caching on (the default)
    ("float32", 1, 64, dict(block_size=16, enable_prefix_caching=False)),
    ("float32", 8, 64, dict(block_size=4, max_num_batched_tokens=64)),  # chunked prefill; drafts cut to the budget
    ("bfloat16", 3, 32, dict(block_size=8)),
])
def test_greedy_identity_early_exit_draft(drafts, prompts64, dtype, k, num_prompts, kw):
    params = SamplingParams(temperature=0, max_tokens=32)
    base = dict(dtype=dtype, num_kv_blocks=1024, **kw)
    ref, _ = _run(prompts64[:num_prompts], params, **base)
    got, stats = _run(prompts64[:num_prompts], params, speculative_config=_spec(drafts["early_exit"], k), **base)
    assert got == ref
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert len(stats.acceptance_rate_per_position) == k


def test_target_as_its_own_draft_accepts_everything(drafts, prompts64):
    """The target drafting for itself proposes exactly its own argmax (the CPU's kernels are batch
    invariant: a row's logits do not depend on how many rows share its step): 100% acceptance."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = dict(num_kv_blocks=512, block_size=4)
    ref, _ = _run(prompts64[:16], params, **base)
    got, stats = _run(prompts64[:16], params, speculative_config=_spec(drafts["self"], 4), **base)
    assert got == ref
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.acceptance_rate_per_position == (1.0,) * 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_identity_under_preemption_tiny_cache(drafts, prompts64, mode):
    """A cache too small for the batch: sequences are preempted while they hold lookahead slots
    (the draft forgets them and computes its cache again when they come back)."""
    params = SamplingParams(temperature=0, max_tokens=24)
    base = dict(num_kv_blocks=24, block_size=4, max_model_len=96, preemption_mode=mode)
    ref, _ = _run(prompts64[:6], params, **base)
    got, stats = _run(prompts64[:6], params, speculative_config=_spec(drafts["early_exit"], 4), **base)
    assert got == ref
    assert stats.num_preemptions > 0 and stats.num_accepted_tokens > 0


@pytest.mark.parametrize("draft", ["self", "early_exit"])
def test_stops_inside_accepted_tokens_and_logprobs(drafts, prompts64, draft):
    """Greedy requests with stop strings, min_tokens, logprobs and max_tokens ending mid-proposal,
    n > 1 beside them: the same tokens, texts, logprobs and finish reasons as speculation off. With
    the target as its own draft every draft is accepted, so the stops are met inside accepted
    tokens; with the early-exit one mostly at a rejection."""
    cases = [
        SamplingParams(temperature=0, max_tokens=29, stop=[" the", "."], min_tokens=3),
        SamplingParams(temperature=0, max_tokens=33, logprobs=2, repetition_penalty=1.2),
        SamplingParams(temperature=0, max_tokens=7),  # k = 5 drafts cut to what max_tokens leaves
        SamplingParams(temperature=0, n=2, max_tokens=12),
    ]
    prompts = prompts64[:12]
    params = [cases[i % len(cases)] for i in range(len(prompts))]
    base = dict(num_kv_blocks=512, block_size=4)
    ref = LLM(STORIES, **base).generate(prompts, params, use_tqdm=False)
    llm = LLM(STORIES, speculative_config=_spec(drafts[draft], 5), **base)
    got = llm.generate(prompts, params, use_tqdm=False)
    for r, g in zip(ref, got):
        assert len(r.outputs) == len(g.outputs)
        for rc, gc in zip(r.outputs, g.outputs):
            assert (gc.token_ids, gc.text, gc.finish_reason, gc.stop_reason) == (rc.token_ids, rc.text, rc.finish_reason, rc.stop_reason)
            assert gc.logprobs == rc.logprobs and gc.cumulative_logprob == rc.cumulative_logprob
    assert llm.get_stats().num_accepted_tokens > 0
    assert any(c.stop_reason in (" the", ".") for r in got for c in r.outputs)


# ----- sampling ------------------------------------------------------------------------------------------
def test_seeded_sampling_depends_on_the_seed_only(drafts, prompts64):
    """Seeded requests (n = 3, penalties, top-k/top-p, logprobs) give the same tokens alone and in
    a batch, and their logprobs are the target's (those of a prefill of the same tokens)."""
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, presence_penalty=0.3, seed=7, n=3, max_tokens=20, logprobs=1)
    spec = dict(num_kv_blocks=512, block_size=4, speculative_config=_spec(drafts["early_exit"], 3))
    llm = LLM(STORIES, **spec)
    alone = llm.generate([prompts64[0]], params, use_tqdm=False)[0]
    other = SamplingParams(temperature=1.0, max_tokens=25)
    batched = llm.generate([prompts64[5], prompts64[0], prompts64[9]], [other, params, other], use_tqdm=False)[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in batched.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1  # the n completions draw apart
    assert llm.get_stats().num_accepted_tokens > 0
    scorer = LLM(STORIES, num_kv_blocks=512, block_size=4)
    for c in alone.outputs:
        ids = alone.prompt_token_ids + list(c.token_ids)
        scored = scorer.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        want = [scored.prompt_logprobs[len(alone.prompt_token_ids) + i][tok].logprob for i, tok in enumerate(c.token_ids)]
        got = [entry[tok].logprob for entry, tok in zip(c.logprobs, c.token_ids)]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("draft, temperature", [("random", 1.0), ("early_exit", 0.8)])
def test_sampled_tokens_follow_the_target(drafts, hf_model, draft, temperature):
    """Chi-square (fixed seeds, many draws): generated tokens 2 to 4, decided by speculative steps
    (an accepted draft, a recovered or a bonus token), follow transformers' softmax of the target
    given the tokens before them, for a random-weight draft (mostly rejected: recovered tokens) and
    an early-exit one (accepted more often). Each prefix seen at least 40 times is one group; the
    statistics of the groups add up (the conditionals of a sequence factor its likelihood)."""
    n = 1500
    llm = LLM(STORIES, num_kv_blocks=2048, block_size=8, speculative_config=_spec(drafts[draft], 3))
    prompt = llm.tokenizer("Once upon a time, there was a")["input_ids"]
    # max_tokens 5: the step after the first token proposes k = 3 drafts (k + 1 tokens fit)
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=5, ignore_eos=True) for s in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_draft_tokens >= 3 * n
    tokens = np.array([o.outputs[0].token_ids[:4] for o in outs])  # [n, 4]
    stat, dof = 0.0, 0
    for j in (1, 2, 3):  # token j + 1 given tokens 1..j
        prefixes, inverse, counts = np.unique(tokens[:, :j], axis=0, return_inverse=True, return_counts=True)
        groups = [g for g in range(len(prefixes)) if counts[g] >= 40]
        if not groups:
            continue
        with torch.no_grad():
            ids = torch.tensor([prompt + prefixes[g].tolist() for g in groups])
            p = (hf_model(ids).logits[:, -1].double() / temperature).softmax(-1).numpy()  # [G, vocab]
        for row, g in enumerate(groups):
            observed = np.bincount(tokens[inverse.reshape(-1) == g, j], minlength=p.shape[1]).astype(float)
            expected = p[row] * counts[g]
            big = expected >= 5
            obs = np.append(observed[big], observed[~big].sum())
            exp = np.append(expected[big], expected[~big].sum())
            keep = exp > 0
            stat += float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
            dof += int(keep.sum()) - 1
    assert dof >= 10, dof
    assert chi2.sf(stat, dof) > 1e-3, (stat, dof)
    rate = stats.num_accepted_tokens / stats.num_draft_tokens
    assert (rate < 0.3) if draft == "random" else (rate > 0.1), rate


# ----- the engine's share ------------------------------------------------------------------------------
def test_kv_budget_counts_both_models(drafts):
    """One pool: each block costs the target's and the draft's bytes."""
    budget = 1 << 20
    plain = LLM(STORIES, kv_cache_memory_bytes=budget, max_model_len=256)
    spec = LLM(STORIES, kv_cache_memory_bytes=budget, max_model_len=256, speculative_config=_spec(drafts["early_exit"], 2))
    target_block = plain.model_config.kv_bytes_per_token() * 16
    draft_block = spec.draft_model.config.kv_bytes_per_token() * 16
    assert plain.cache_config.num_blocks == budget // target_block
    assert spec.cache_config.num_blocks == budget // (target_block + draft_block)
    runner = spec.llm_engine.model_runner
    assert len(runner.drafter.kv_caches) == 4 and runner.drafter.kv_caches[0][0].shape[0] == spec.cache_config.num_blocks


@pytest.mark.parametrize("changes, tokenizer, words", [
    ({"vocab_size": 519}, STORIES, r"vocab_size 519, the target has 512"),
    ({"max_position_embeddings": 64}, STORIES, r"max_position_embeddings 64, fewer than max_model_len=512"),
    ({}, GPT2_TOKENIZER, r"tokenizer other than the target's"),
])
def test_refused_drafts(tmp_path, changes, tokenizer, words):
    if not os.path.isdir(tokenizer):
        pytest.skip(f"no tokenizer at {tokenizer}")
    draft = make_draft(tmp_path / "draft", 1, config_changes=changes, tokenizer_from=tokenizer)
    with pytest.raises(ValueError, match=words):
        LLM(STORIES, num_kv_blocks=64, speculative_config=_spec(draft, 2))


def test_refused_executors_and_beams(drafts, prompts64):
    with pytest.raises(ValueError, match="distributed_executor_backend=None"):
        LLM(STORIES, distributed_executor_backend="pickle", speculative_config=_spec(drafts["early_exit"], 2))
    from pagedgen import BeamSearchParams

    llm = LLM(STORIES, num_kv_blocks=256, speculative_config=_spec(drafts["early_exit"], 3))
    beams = llm.beam_search([{"prompt": prompts64[0]}], BeamSearchParams(beam_width=2, max_tokens=10))
    ref = LLM(STORIES, num_kv_blocks=256).beam_search([{"prompt": prompts64[0]}], BeamSearchParams(beam_width=2, max_tokens=10))
    assert [s.tokens for s in beams[0].sequences] == [s.tokens for s in ref[0].sequences]
    assert llm.get_stats().num_draft_tokens == 0  # beams do not speculate


def test_early_exit_writer_checks_its_arguments(tmp_path):
    for bad in (0, 6, 2.0):
        with pytest.raises(ValueError, match=r"num_layers must be in \[1, 5\]"):
            write_early_exit_draft(STORIES, str(tmp_path / f"d{bad}"), bad)
    with pytest.raises(FileNotFoundError, match="config.json"):
        write_early_exit_draft(str(tmp_path), str(tmp_path / "d"), 1)
    folder = write_early_exit_draft(STORIES, str(tmp_path / "two"), 2)
    from safetensors import safe_open
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.1.mlp.up_proj.weight"} <= names
    assert not any(n.startswith(("model.layers.2.", "model.layers.4.")) for n in names)
    with pytest.raises(FileExistsError):
        write_early_exit_draft(STORIES, folder, 2)


def test_sampler_propose_processes_and_draws_as_the_sampler():
    """``Sampler.propose`` (a draft's proposals) applies the target's processing and draws: with no
    stream tag it picks the very tokens ``Sampler.__call__`` picks, and q is the distribution drawn
    from (one-hot for greedy rows); a tag moves the draws to another stream."""
    from pagedgen.core.sequence import Sequence
    from pagedgen.sample.rejection_sampler import DRAFT_STREAM
    from pagedgen.sample.sampler import Sampler, as_int64

    cases = [SamplingParams(temperature=0.8, top_k=20, seed=3), SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.7),
             SamplingParams(temperature=0, repetition_penalty=1.3), SamplingParams(temperature=1.3, min_p=0.05, seed=9, min_tokens=5)]
    seqs = [Sequence(seq_id=i, request_id=str(i), token_ids=[1, 5, 7, 5, 9], num_prompt_tokens=2, sampling_params=p,
                     eos_token_ids=frozenset({2}), max_model_len=512, seed=None if p.seed is None else as_int64(p.seed)) for i, p in enumerate(cases)]
    sampler = Sampler(0)
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(len(seqs), 64, generator=g) * 3  # [R, vocab]
        want = sampler(logits.clone(), seqs).token_ids
        tokens, q = sampler.propose(logits.clone(), seqs, 0)
        assert tokens.tolist() == want
        assert q.shape == (len(seqs), 64) and torch.allclose(q.sum(-1), torch.ones(len(seqs)))
        assert all(q[i, t] > 0 for i, t in enumerate(want))
        assert q[1, want[1]] == 1.0 and q[3, want[3]] == 1.0  # greedy rows: one-hot
        assert q[4, 2] == 0.0  # min_tokens bans EOS in the draft's distribution too
    differ = 0
    for trial in range(30):  # near-uniform rows: another stream's draw gives another token
        logits = torch.randn(len(seqs), 64, generator=g) * 0.1
        differ += sampler.propose(logits.clone(), seqs, DRAFT_STREAM)[0][0].item() != sampler(logits.clone(), seqs).token_ids[0]
    assert differ >= 20
    greedy_only, q = sampler.propose(torch.randn(2, 64, generator=g), [seqs[1], seqs[3]], DRAFT_STREAM)
    assert q is None and greedy_only.shape == (2,)


def test_structured_outputs_are_not_speculated(drafts, prompts64):
    """A step with a structured-output request proposes nothing (its bitmask is not applied to
    drafts): outputs as speculation off, no drafts."""
    from pagedgen import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=r"( [a-z]+){3}\."))
    base = dict(num_kv_blocks=256, block_size=4)
    ref, _ = _run(prompts64[:2], params, **base)
    got, stats = _run(prompts64[:2], params, speculative_config=_spec(drafts["early_exit"], 3), **base)
    assert got == ref and stats.num_draft_tokens == 0


def test_cli_summary_reports_acceptance(drafts, tmp_path, capsys):
    """``--speculative-config`` with a draft model on the command line: completions as speculation
    off (greedy), and the closing summary's acceptance line."""
    from cli_util import read_jsonl, run_cli

    src = tmp_path / "prompts.txt"
    src.write_text("Once upon a time\nThe little dog\n")
    argv = ["--model", STORIES, "--input", src, "--temperature", "0", "--max-tokens", "16", "--num-kv-blocks", "128"]
    rc, err = run_cli(capsys, *argv, "--output", tmp_path / "off.jsonl")
    assert rc == 0, err
    spec = json.dumps(_spec(drafts["early_exit"], 3))
    rc, err = run_cli(capsys, *argv, "--output", tmp_path / "on.jsonl", "--speculative-config", spec)
    assert rc == 0, err
    off, on = read_jsonl(tmp_path / "off.jsonl"), read_jsonl(tmp_path / "on.jsonl")
    assert [r["completions"] for r in on] == [r["completions"] for r in off]
    assert "pagedgen: speculative decoding:" in err and "draft tokens accepted" in err


def test_cli_resume_binds_a_draft_model_but_not_ngram(drafts, tmp_path, capsys):
    """On resume, a draft model's ``--speculative-config`` binds the output like the model (its
    sampled tokens come from the draft's draws); n-gram speculation is a performance flag (on, off
    or another k: the same tokens)."""
    from cli_util import read_jsonl, run_cli

    src = tmp_path / "prompts.txt"
    src.write_text("Once upon a time\nThe little dog\n")
    argv = ["--model", STORIES, "--input", src, "--temperature", "0.8", "--seed", "1", "--max-tokens", "8", "--num-kv-blocks", "128"]
    draft3, draft2 = json.dumps(_spec(drafts["early_exit"], 3)), json.dumps(_spec(drafts["early_exit"], 2))
    out = tmp_path / "draft.jsonl"
    rc, err = run_cli(capsys, *argv, "--output", out, "--speculative-config", draft3)
    assert rc == 0, err
    with open(src, "a") as f:
        f.write("A big red ball\n")
    for other in (draft2, "null", json.dumps({"method": "ngram", "num_speculative_tokens": 3})):
        rc, err = run_cli(capsys, *argv, "--output", out, "--speculative-config", other)
        assert rc == 2 and "parameters differ" in err and "speculative_config" in err, err
    assert len(read_jsonl(out)) == 2  # the refused runs wrote nothing
    rc, err = run_cli(capsys, *argv, "--output", out, "--speculative-config", draft3)
    assert rc == 0, err
    assert [r["index"] for r in read_jsonl(out)] == [0, 1, 2]

    out, src2 = tmp_path / "ngram.jsonl", tmp_path / "two.txt"
    src2.write_text("Once upon a time\nThe little dog\n")
    argv2 = [src2 if a == src else a for a in argv]
    rc, err = run_cli(capsys, *argv2, "--output", out, "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
    assert rc == 0, err
    with open(src2, "a") as f:
        f.write("A big red ball\n")
    rc, err = run_cli(capsys, *argv2, "--output", out)  # speculation off now: resumes
    assert rc == 0, err
    assert [r["index"] for r in read_jsonl(out)] == [0, 1, 2]


def test_a_step_that_fails_in_the_draft_leaves_the_llm_as_fresh(drafts, prompts64, monkeypatch):
    """An exception inside a draft pass aborts the call; the next call's outputs (greedy and
    seeded) equal a fresh LLM's, the draft's per-sequence counts forgotten with the tables."""
    from pagedgen.spec_decode.draft_model import DraftModelProposer

    params = [SamplingParams(temperature=0, max_tokens=20), SamplingParams(temperature=0.9, seed=4, max_tokens=20)] * 3
    spec = dict(num_kv_blocks=256, block_size=4, speculative_config=_spec(drafts["early_exit"], 3))
    fresh = LLM(STORIES, **spec).generate(prompts64[:6], params, use_tqdm=False)
    llm = LLM(STORIES, **spec)
    real, calls = DraftModelProposer._forward, [0]

    def failing(self, *args):
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("draft pass failed")
        return real(self, *args)

    monkeypatch.setattr(DraftModelProposer, "_forward", failing)
    with pytest.raises(RuntimeError, match="draft pass failed"):
        llm.generate(prompts64[:6], params, use_tqdm=False)
    assert not llm.llm_engine.block_manager.check()
    again = llm.generate(prompts64[:6], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in fresh]
    runner = llm.llm_engine.model_runner  # the draft forgets a sequence with its table (the next step's freed ids)
    assert runner.drafter.num_computed and all(seq_id in runner.block_tables for seq_id in runner.drafter.num_computed)


def test_batched_rejection_sampler_equals_the_loop():
    """``rejection_sample_batch`` (tensor ops, all sequences at once) emits the tokens of
    ``rejection_sample`` (the plain loop), over random targets, drafts, k and draws, including
    greedy (one-hot) rows and drafts equal to the target."""
    from pagedgen.sample.rejection_sampler import rejection_sample, rejection_sample_batch

    g = torch.Generator().manual_seed(5)
    vocab, K = 7, 5
    for trial in range(40):
        G = 1 + trial % 6
        ks = torch.randint(1, K + 1, (G,), generator=g)
        p = torch.softmax(torch.randn(G, K + 1, vocab, generator=g) * (1 + trial % 3), dim=-1)
        q = torch.softmax(torch.randn(G, K, vocab, generator=g) * 2, dim=-1)
        if trial % 4 == 0:  # greedy rows: one-hot target and draft
            p = torch.nn.functional.one_hot(p.argmax(-1), vocab).float()
            q = torch.nn.functional.one_hot(q.argmax(-1), vocab).float()
        if trial % 5 == 0:
            q = p[:, :K].clone()  # a perfect draft
        d = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(G, K)
        au = torch.rand(G, K, generator=g, dtype=torch.float64)
        ru = torch.rand(G, K + 1, generator=g, dtype=torch.float64)
        tokens, emitted = rejection_sample_batch(p, d, ks, q, au, ru)
        for i in range(G):
            k = int(ks[i])
            want = rejection_sample(p[i, : k + 1], d[i, :k].tolist(), q[i, :k], au[i, :k], ru[i, : k + 1])
            assert tokens[i, : int(emitted[i])].tolist() == want, (trial, i)
