"""The draft model of method ``"draft_model"`` (worker side): its paged KV cache and its proposals.

The draft's KV cache shares the target's block ids: block b of the draft's cache holds the draft's
keys and values of the tokens whose target keys and values are in block b of the target's cache, so
one block manager, one block table and one slot mapping serve both models, and a block of the pool
costs target bytes + draft bytes (``engine/build.py`` sizes the pool with both; core/kv_sizing.py).

    target cache  layer l  [num_blocks, block_size, kv_heads,       head_dim      ]   same block ids,
    draft cache   layer l' [num_blocks, block_size, draft_kv_heads, draft_head_dim]   same slots

Copy-on-write copies a block in both caches (``ModelRunner.move_blocks``). Swap preemption moves
only the target's blocks: a preempted sequence is forgotten here (the scheduler frees its table
in the worker's mirror either way, ``freed_seq_ids``), and the draft computes its cache again.

Per sequence the draft knows how many of its tokens it has in its cache (``num_computed``, a
prefix of positions; never more than the target's ``num_computed_tokens``, and reset when the
sequence's table is freed). A speculative step of a sequence with L tokens (the target computes
its last token, position L - 1, and k draft tokens) runs k draft passes, batched over the step's
speculating sequences:

    pass 0    rows c .. L - 1 (catching up: the prompt on its first step, the last draft and the
              bonus token after a step where all were accepted; else only L - 1) -> d_0
    pass j    one row, d_{j-1} at position L + j - 1                           -> d_j   (1 <= j < k)

writing its keys and values in the target's slots of those positions (the lookahead slots the
scheduler reserved for the drafts). After the step its count is L + k - 1; the next step clamps it
to the target's count, which covers the rollback of rejected drafts: their slots are overwritten
later. Each proposal is drawn by ``Sampler.propose`` with the request's own sampling parameters on
the sequence as if the earlier drafts were committed (spec_decode/verify.py's view), keeping q for the
rejection sampler (sample/rejection_sampler.py).
"""
from __future__ import annotations

from itertools import accumulate
from typing import Optional

import torch

from pagedgen.config import CacheConfig
from pagedgen.ops import AttentionMetadata
from pagedgen.sample.rejection_sampler import DRAFT_STREAM
from pagedgen.sample.sampler import Sampler
from pagedgen.spec_decode.verify import view
from pagedgen.worker.block_tables import BlockTables, int_tensor


class DraftModelProposer:
    """A draft model, its KV cache and its per-sequence progress.

    Args:
        model: the loaded draft model (same vocabulary as the target, same device and dtype).
        cache_config: the target's (the draft's cache has the same blocks).
        sampler: the target's sampler (its draws and logit processing).
    """

    def __init__(self, model, cache_config: CacheConfig, sampler: Sampler) -> None:
        self.model = model
        self.sampler = sampler
        self.block_size = cache_config.block_size
        cfg = model.config
        shape = (cache_config.num_blocks, cache_config.block_size, cfg.num_kv_heads, cfg.head_dim)
        # torch.empty: pages backed on first use (the runner's prefaulter touches them with the target's)
        self.kv_caches = [
            (torch.empty(shape, dtype=cfg.dtype, device=model.device), torch.empty(shape, dtype=cfg.dtype, device=model.device))
            for _ in range(cfg.num_layers)
        ]
        self.num_computed: dict[int, int] = {}  # seq_id -> tokens whose draft keys and values are cached

    def forget(self, seq_ids) -> None:
        """The tables of ``seq_ids`` were freed (finished, aborted, preempted): their blocks may
        hold anything from now on."""
        for seq_id in seq_ids:
            self.num_computed.pop(seq_id, None)

    def propose(self, seqs: list, ks: list[int], tables: BlockTables) -> tuple[list[list[int]], list[Optional[torch.Tensor]]]:
        """Draft tokens for ``seqs`` (decode sequences whose last token the target computes this
        step), ``ks[i]`` for ``seqs[i]``, their slots already in ``tables``. Returns the drafts per
        sequence and their q: [k_i, vocab] float32 on the model's device for a sampled sequence,
        None for a greedy one (its verification compares argmaxes)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[Optional[list[torch.Tensor]]] = [None if seq.sampling_params.greedy else [] for seq in seqs]
        lengths = [len(seq.token_ids) for seq in seqs]
        starts = [min(self.num_computed.get(seq.seq_id, 0), seq.num_computed_tokens) for seq in seqs]
        inputs = [seq.token_ids[c:] for seq, c in zip(seqs, starts)]  # pass 0: catch up, then the last token
        active = list(range(len(seqs)))
        for j in range(max(ks)):
            logits = self._forward([seqs[i].seq_id for i in active], [starts[i] for i in active], [inputs[i] for i in active], tables)  # [A, vocab]
            views = [seqs[i] if seqs[i].plain_greedy else view(seqs[i], drafts[i]) for i in active]  # plain greedy: only the argmax
            tokens, q = self.sampler.propose(logits, views, DRAFT_STREAM)  # [A] int64, [A, vocab] float32
            for a, (i, tok) in enumerate(zip(active, tokens.tolist())):
                drafts[i].append(tok)
                if qs[i] is not None:
                    qs[i].append(q[a])  # [vocab]
            active = [i for i in active if ks[i] > j + 1]
            for i in active:  # the next pass: the draft just proposed, at its position
                starts[i] = lengths[i] + j
                inputs[i] = [drafts[i][-1]]
        for seq, length, k in zip(seqs, lengths, ks):
            self.num_computed[seq.seq_id] = length + k - 1
        return drafts, [None if rows is None else torch.stack(rows) for rows in qs]

    def _forward(self, seq_ids: list[int], starts: list[int], inputs: list[list[int]], tables: BlockTables) -> torch.Tensor:
        """One draft pass: sequence i computes ``inputs[i]`` at positions ``starts[i]..``; returns
        the logits [len(seq_ids), vocab] of each sequence's last row (model dtype)."""
        bs, dev = self.block_size, self.model.device
        counts = [len(x) for x in inputs]
        ends = [c + n for c, n in zip(starts, counts)]
        qsl = list(accumulate(counts, initial=0))  # [n + 1]
        n, num_tokens = len(seq_ids), qsl[-1]
        max_seq_len = max(ends)
        block_tables = tables.gather(seq_ids, -(-max_seq_len // bs))  # [n, width] int32
        seq_index = torch.repeat_interleave(torch.arange(n), int_tensor(counts, torch.int64), output_size=num_tokens)  # [T]
        positions = torch.arange(num_tokens) + (int_tensor(starts, torch.int64) - int_tensor(qsl[:-1], torch.int64))[seq_index]  # [T]
        flat_block = seq_index * block_tables.shape[1] + torch.div(positions, bs, rounding_mode="floor")  # [T]
        slots = block_tables.view(-1)[flat_block].to(torch.int64) * bs + positions % bs  # [T] int64
        attn = AttentionMetadata(
            slot_mapping=slots.to(dev),  # [T]
            block_tables=block_tables.to(dev),  # [n, width]
            seq_lens=int_tensor(ends, torch.int32).to(dev),  # [n]
            query_start_loc=int_tensor(qsl, torch.int32).to(dev),  # [n + 1]
            max_seq_len=max_seq_len,
        )
        input_ids = int_tensor([t for x in inputs for t in x], torch.int64).to(dev)  # [T]
        logits_indices = int_tensor([e - 1 for e in qsl[1:]], torch.int64).to(dev)  # [n]
        return self.model.forward(input_ids, positions.to(dev), attn, self.kv_caches, logits_indices)  # [n, vocab]
