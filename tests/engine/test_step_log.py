"""Per-step recording (``LLM.start_recording`` / ``stop_recording``, ``StepLog``): its columns add
up to the engine's own counters, it changes no output, and it is off unless asked for."""
import numpy as np
import pytest

from conftest import story_openings
from pagedgen import LLM, SamplingParams
from pagedgen.engine.step_log import StepLog


def _requests(n: int):
    prompts = story_openings(n, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=8 + (7 * i) % 40, ignore_eos=True) for i in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def small(stories_path, one_torch_thread):
    """A small cache (24 blocks, 8 sequences) that fills up and preempts."""
    return LLM(stories_path, num_kv_blocks=24, max_model_len=256, max_num_seqs=8, seed=0)


def test_off_by_default_and_stop_without_start(llm):
    assert llm.llm_engine.step_log is None
    with pytest.raises(RuntimeError, match="start_recording"):
        llm.stop_recording()


def test_columns_add_up_to_the_engine_counters(stories_path, one_torch_thread):
    llm = LLM(stories_path, num_kv_blocks=24, max_model_len=256, max_num_seqs=8, seed=0)
    prompts, params = _requests(24)
    log = llm.start_recording()
    assert log.recording and len(log) == 0 and repr(log) == "StepLog(0 steps, recording)"
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stop_recording() is log and not log.recording
    s = llm.get_stats()  # a fresh LLM: its counters cover exactly the recorded steps
    assert len(log) == s.num_steps
    assert log.num_prefill_tokens.sum() == s.num_prefill_tokens and log.num_decode_tokens.sum() == s.num_decode_tokens
    assert log.num_generated_tokens.sum() == s.num_generated_tokens == sum(len(o.outputs[0].token_ids) for o in outputs)
    assert log.num_preemptions.sum() == s.num_preemptions > 0  # the small cache preempted
    assert log.num_finished.sum() == len(prompts)
    assert log.num_used_blocks.max() == s.peak_used_blocks <= log.num_kv_blocks == 24
    assert np.isclose(log.kv_utilization.mean(), s.kv_utilization_mean)
    assert np.allclose(log.kv_usage, log.num_used_blocks / 24)
    assert log.num_running.max() <= 8 and log.num_running[0] + log.num_waiting[0] == 24  # all queued at step 0
    assert (np.diff(log.time_s) >= 0).all() and log.time_s[0] >= 0
    assert (log.num_prefill_tokens + log.num_decode_tokens > 0).all()  # every step computed something
    table = log.to_dict()
    assert list(table) == list(StepLog.COLUMNS) and all(len(v) == len(log) for v in table.values())
    assert repr(log).startswith(f"StepLog({len(log)} steps over ") and f"{s.num_preemptions} preemptions" in repr(log)


def test_recording_changes_no_output_and_a_second_start_begins_a_new_log(small):
    prompts, params = _requests(16)
    plain = small.generate(prompts, params, use_tqdm=False)
    steps_before = small.get_stats().num_steps
    first = small.start_recording()
    small.generate(prompts[:2], params[:2], use_tqdm=False)
    second = small.start_recording()  # stops the first, starts afresh
    assert not first.recording and len(first) > 0
    recorded = small.generate(prompts, params, use_tqdm=False)
    small.stop_recording()
    assert [o.outputs[0].token_ids for o in recorded] == [o.outputs[0].token_ids for o in plain]
    assert len(first) + len(second) == small.get_stats().num_steps - steps_before
    # a log started on a used engine counts from its own start, not from the engine's
    assert second.num_generated_tokens.sum() == sum(len(o.outputs[0].token_ids) for o in recorded)


def test_swapped_sequences_are_recorded(stories_path, one_torch_thread):
    llm = LLM(stories_path, num_kv_blocks=24, max_model_len=256, max_num_seqs=8, preemption_mode="swap", seed=0)
    prompts, params = _requests(16)
    log = llm.start_recording()
    llm.generate(prompts, params, use_tqdm=False)
    llm.stop_recording()
    s = llm.get_stats()
    assert s.num_swaps_out > 0 and log.num_swapped.max() > 0
    assert log.num_preemptions.sum() == s.num_preemptions
