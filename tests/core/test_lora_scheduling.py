"""LoRA in the scheduler and the prefix cache, without a model: a step never runs more distinct
adapters than ``max_loras`` (a request whose adapter would be one more waits, first come first
served), and a block computed under one adapter is never found for another or the base model."""
import random

from pagedgen.config import SchedulerConfig
from pagedgen.core.block_manager import BlockManager
from pagedgen.core.scheduler import Scheduler
from pagedgen.core.sequence import Sequence
from pagedgen.lora.request import LoRARequest
from pagedgen.sampling_params import SamplingParams


def _seq(i: int, lora_id: int, prompt_len: int = 6, max_tokens: int = 5) -> Sequence:
    return Sequence(
        seq_id=i, request_id=str(i), token_ids=list(range(3, 3 + prompt_len)), num_prompt_tokens=prompt_len,
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens), eos_token_ids=frozenset([2]), max_model_len=1000,
        lora_request=None if lora_id == 0 else LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}"),
    )


def _run(sched: Scheduler, seqs: list[Sequence]) -> list[set]:
    """Step until every sequence finished; the distinct adapters of each step."""
    for s in seqs:
        sched.add(s)
    per_step = []
    while sched.has_unfinished():
        out = sched.schedule()
        planned = [sched.seqs[i] for i in out.seq_ids]
        per_step.append({s.lora_int_id for s in planned} - {0})
        finished = []
        for seq, n in zip(planned, out.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens and seq.append_token(7):
                finished.append(seq)
        sched.finish_many(finished)
    return per_step


def test_no_step_runs_more_adapters_than_max_loras():
    rng = random.Random(0)
    for max_loras in (1, 2, 3):
        for preemption in ("recompute", "swap"):
            bm, cpu = BlockManager(12, 4), BlockManager(64, 4)
            sched = Scheduler(SchedulerConfig(8, 64, 1000, preemption, max_loras=max_loras), bm, cpu)
            seqs = [_seq(i, rng.choice([0, 0, 1, 2, 3, 4, 5]), rng.randint(2, 12), rng.randint(1, 9)) for i in range(40)]
            per_step = _run(sched, seqs)
            assert max(len(s) for s in per_step) <= max_loras
            assert all(s.is_finished for s in seqs)
            assert any(len(s) == max_loras for s in per_step)  # the slots are used, not just respected


def test_the_head_of_the_queue_waits_for_a_slot_and_is_not_overtaken():
    sched = Scheduler(SchedulerConfig(8, 64, 1000, max_loras=1), BlockManager(64, 4))
    a, b, base = _seq(0, 1, max_tokens=3), _seq(1, 2), _seq(2, 0)
    for s in (a, b, base):
        sched.add(s)
    out = sched.schedule()
    assert out.seq_ids == [0]  # b's adapter would be a second; base behind b waits too (FCFS)
    steps = _run(sched, [])
    assert steps[0] == {1} and {2} in steps


def test_prefix_cache_is_keyed_by_adapter():
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    tokens = list(range(10, 23))  # 13 tokens: 3 full blocks can hit
    under = {lora: _seq(lora, lora) for lora in (0, 1, 2)}
    bm.allocate(100, len(tokens), tokens, salt=under[1].cache_salt)  # computed under adapter 1
    assert len(bm.match_prefix(tokens, under[1].cache_salt)) == 3
    assert bm.match_prefix(tokens, under[2].cache_salt) == []
    assert bm.match_prefix(tokens, under[0].cache_salt) == [] and bm.match_prefix(tokens) == []
    bm.allocate(101, len(tokens), tokens)  # the base model's own blocks
    assert len(bm.match_prefix(tokens)) == 3 and set(bm.match_prefix(tokens)).isdisjoint(bm.match_prefix(tokens, under[1].cache_salt))
    child = under[1].fork(9, 1)
    assert child.cache_salt == under[1].cache_salt and child.lora_int_id == 1
