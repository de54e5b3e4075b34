"""Sampling on the logits' device: ``sampler`` (penalties, temperature, top-k/top-p/min-p, counter-
based draws keyed by (seed, completion, position), greedy), ``logprobs`` (top-k logprobs and the
sampled token's rank), ``logits_processors`` (penalties, logit bias, banned and allowed tokens,
min-p, top-k/top-p: plain functions over rows) and ``rejection_sampler``
(speculative decoding's Leviathan/Chen accept/reject rule). Imports nothing of ``core``'s
scheduler or block manager."""
