"""LLM.generate_stream (lazy, bounded, completion order, bad items, early close) and threads sharing
one LLM (a lock serialises calls; re-entry from inside a stream is a RuntimeError at once)."""
import threading

import pytest

from conftest import story_openings
from pagedgen import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return story_openings(24, seed=11)


@pytest.fixture(scope="module")
def expected(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _idle(llm):
    engine = llm.llm_engine
    bm = engine.block_manager
    return not engine.has_unfinished_requests() and bm.check() == [] and bm.num_free_blocks == bm.num_blocks


def test_stream_pulls_lazily_and_yields_every_index_once(llm, prompts, expected):
    pulled, in_flight = [], []
    real_step = llm.llm_engine.step

    def source():
        for i, p in enumerate(prompts):
            pulled.append(i)
            yield p if i % 3 else (p, GREEDY.clone(max_tokens=5))  # a tuple: the item's own parameters

    def step():
        in_flight.append(llm.llm_engine.get_num_unfinished_requests())
        return real_step()

    llm.llm_engine.step = step
    try:
        stream = llm.generate_stream(source(), GREEDY, max_in_flight=5)
        assert pulled == []  # nothing happens before the first next()
        outs = list(stream)
    finally:
        del llm.llm_engine.step
    assert sorted(o.index for o in outs) == list(range(len(prompts)))
    assert all(o.request_id == str(o.index) for o in outs)
    for o in outs:
        want = expected[o.index][:5] if o.index % 3 == 0 else expected[o.index]
        assert o.outputs[0].token_ids == want
    assert max(in_flight) == 5 and _idle(llm)


def test_bad_item_raises_after_the_items_before_it(llm, prompts, expected):
    items = prompts[:4] + [[1, 99999]] + prompts[4:8]
    got = []
    with pytest.raises(ValueError, match=r"prompts\[4\] has token id 99999 outside the vocabulary"):
        for out in llm.generate_stream(items, GREEDY, max_in_flight=3):
            got.append(out.index)
    assert sorted(got) == [0, 1, 2, 3] and _idle(llm)
    broken = SamplingParams(max_tokens=2)
    broken.max_tokens = 0
    with pytest.raises(ValueError, match=r"sampling_params of prompts\[1\]: SamplingParams.max_tokens must be at least 1"):
        list(llm.generate_stream([prompts[0], (prompts[1], broken), prompts[2]]))
    with pytest.raises(TypeError, match=r"prompts\[1\] is a \(prompt, sampling_params\) tuple whose second element must be a SamplingParams, got str"):
        list(llm.generate_stream([prompts[0], (prompts[1], "notparams")]))
    with pytest.raises(ValueError, match="max_in_flight must be >= 1"):
        llm.generate_stream(prompts, max_in_flight=0)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or None"):
        llm.generate_stream(prompts, [GREEDY])
    assert _idle(llm)


def test_a_failing_source_finishes_what_it_gave_then_raises(llm, prompts, expected):
    class Boom(Exception):
        pass

    def source():
        yield from prompts[:13]
        raise Boom("the source failed")

    got = []
    with pytest.raises(Boom, match="the source failed"):
        for out in llm.generate_stream(source(), GREEDY, max_in_flight=6):
            got.append(out.index)
            assert out.outputs[0].token_ids == expected[out.index]
    assert sorted(got) == list(range(13)) and _idle(llm)  # items 8-12 were admitted: they are yielded too

    def interrupted():
        yield from prompts[:9]
        raise KeyboardInterrupt

    got = []
    with pytest.raises(KeyboardInterrupt):
        for out in llm.generate_stream(interrupted(), GREEDY, max_in_flight=6):
            got.append(out.index)
    assert len(got) < 9 and _idle(llm)  # an interrupt still aborts what is in flight


def test_closing_early_aborts_in_flight(llm, prompts, expected):
    items = iter([(prompts[0], GREEDY.clone(max_tokens=3))] + prompts[1:])
    stream = llm.generate_stream(items, GREEDY, max_in_flight=8)
    first = next(stream)
    assert first.index == 0 and first.outputs[0].token_ids == expected[0][:3]
    assert llm.llm_engine.get_num_unfinished_requests() == 7
    stream.close()
    assert _idle(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], GREEDY, use_tqdm=False)] == expected[:2]


def test_reentry_from_inside_a_stream_is_an_error_at_once(llm, prompts, expected):
    stream = llm.generate_stream(prompts[:6], GREEDY)
    for out in stream:
        with pytest.raises(RuntimeError, match="inside LLM.generate_stream of the same LLM"):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        with pytest.raises(RuntimeError, match="inside LLM.generate_stream"):
            next(llm.generate_stream(prompts[:1]))
        break
    stream.close()
    assert _idle(llm)


@pytest.mark.parametrize("num_threads", [2, 4])
def test_threads_sharing_one_llm_get_correct_results(llm, prompts, expected, num_threads):
    results, errors = {}, []
    chunks = [list(range(t, len(prompts), num_threads)) for t in range(num_threads)]

    def work(t):
        try:
            if t == 1:  # one thread streams while the others call generate
                outs = sorted(llm.generate_stream([prompts[i] for i in chunks[t]], GREEDY), key=lambda o: o.index)
            else:
                outs = llm.generate([prompts[i] for i in chunks[t]], GREEDY, use_tqdm=False)
            results[t] = [o.outputs[0].token_ids for o in outs]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors, errors
    for t in range(num_threads):
        assert results[t] == [expected[i] for i in chunks[t]]
    assert _idle(llm)
