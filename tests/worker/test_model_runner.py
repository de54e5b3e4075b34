"""The model runner's step tensors: the persistent block tables (updated from each step's deltas)
equal the block manager's through preemption, swapping, copy-on-write, prefix caching and an
aborted step; positions and the slot mapping equal their per-token definitions."""
import pytest
import torch
from conftest import story_openings

from pagedgen import LLM, SamplingParams
from pagedgen.worker.block_tables import BlockTables

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.in_process]

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=20, ignore_eos=True)


def _watch(llm, seen):
    """Check every step's tensors against the block manager and the sequences, then run it."""
    runner = llm.llm_engine.model_runner
    real = runner.prepare

    def checked(batch):
        bm = llm.llm_engine.block_manager
        (input_ids, positions, attn, _), sampling, beams, plan = out = real(batch)
        bs = runner.cache_config.block_size
        want_ids, want_pos, want_slots = [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            table = bm.block_table(seq.seq_id)
            assert runner.block_tables.row_list(seq.seq_id) == table
            width = attn.block_tables.shape[1]
            assert attn.block_tables[i].tolist() == (table + [0] * width)[:width]
            start = seq.num_computed_tokens
            assert int(attn.seq_lens[i]) == start + n
            want_ids += seq.token_ids[start : start + n]
            want_pos += range(start, start + n)
            want_slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        assert input_ids.tolist() == want_ids and positions.tolist() == want_pos
        assert attn.slot_mapping.tolist() == want_slots and attn.slot_mapping.dtype == torch.int64
        assert attn.query_start_loc.tolist() == [0, *torch.tensor(batch.num_new_tokens).cumsum(0).tolist()]
        assert attn.max_seq_len == int(attn.seq_lens.max())
        seen["steps"] += 1
        seen["prefill"] += input_ids.shape[0] > len(batch.seqs)
        return out

    runner.prepare = checked
    return runner


@pytest.mark.parametrize("caching, mode", [(True, "recompute"), (False, "swap")])
def test_block_tables_follow_the_block_manager(stories_path, caching, mode):
    llm = LLM(stories_path, num_kv_blocks=12, max_model_len=192, enable_prefix_caching=caching, preemption_mode=mode,
              max_num_batched_tokens=64)
    seen = {"steps": 0, "prefill": 0}
    runner = _watch(llm, seen)
    prompts = story_openings(6, seed=7)
    outs = llm.generate(prompts * 2, [GREEDY, SEEDED] * 6, use_tqdm=False)
    assert all(o.finished for o in outs)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and seen["prefill"] > 0 and seen["steps"] == stats.num_steps
    # the rows of finished sequences are freed by the next step's output; what is left is what it would free
    assert set(runner.block_tables._row) <= set(llm.llm_engine.scheduler._freed)


def test_block_tables_after_an_aborted_step(stories_path):
    """A step that raises after scheduling (its deltas never reached the runner) leaves rows behind;
    the next call's first output frees them and its outputs equal a fresh engine's."""
    llm = LLM(stories_path, num_kv_blocks=24, max_model_len=192)
    prompts = story_openings(4, seed=3)
    expected = [o.outputs[0].token_ids for o in LLM(stories_path, num_kv_blocks=24, max_model_len=192).generate(prompts, GREEDY, use_tqdm=False)]
    runner = llm.llm_engine.model_runner
    real, calls = runner.execute, {"n": 0}

    def failing(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return real(batch)

    runner.execute = failing
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    runner.execute = real
    seen = {"steps": 0, "prefill": 0}
    _watch(llm, seen)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert set(runner.block_tables._row) <= set(llm.llm_engine.scheduler._freed)  # no row leaked


def test_block_tables_unit():
    t = BlockTables(max_blocks=2, rows=1)
    t.apply([], {7: (0, [3, 4, 5])})  # wider than max_blocks: grows
    t.apply([], {8: (0, [9])})  # a second row: grows
    assert t.row_list(7) == [3, 4, 5] and t.row_list(8) == [9]
    t.apply([], {7: (2, [6, 1])})  # copy-on-write of the last block, then a new block
    assert t.gather([8, 7], 4, fallback=None).tolist() == [[9, 0, 0, 0], [3, 4, 6, 1]]
    t.apply([7], {})
    assert 7 not in t and len(t) == 1
    t.apply([], {10: (0, [2])})  # takes 7's old row: the rest of it is zero
    assert t.gather([10], 4, fallback=None).tolist() == [[2, 0, 0, 0]]
    # a delta for a sequence the mirror lacks (start > 0) is left to the fallback
    t.apply([], {11: (1, [5])})
    assert 11 not in t
    assert t.gather([11], 2, fallback=lambda seq_id: [4, 5]).tolist() == [[4, 5]]


def test_block_tables_batched_writes():
    """One apply frees a row and gives it to a new sequence, grows the columns and the rows with
    cells pending: every row equals its table, zero-padded (the cells are written at once)."""
    t = BlockTables(max_blocks=2, rows=2)
    t.apply([], {1: (0, [5, 6]), 2: (0, [7])})
    t.apply([1], {3: (0, [8]), 2: (1, [9, 10, 11]), 4: (0, [12, 13])})  # 3 takes 1's row; 2 grows the columns; 4 a row
    assert 1 not in t and t.row_list(3) == [8] and t.row_list(2) == [7, 9, 10, 11] and t.row_list(4) == [12, 13]
    assert t.gather([3, 2, 4], 4, fallback=None).tolist() == [[8, 0, 0, 0], [7, 9, 10, 11], [12, 13, 0, 0]]
    t.apply([], {2: (1, [14])})  # a shorter table: the cells past it are zeroed
    assert t.gather([2], 4, fallback=None).tolist() == [[7, 14, 0, 0]]
