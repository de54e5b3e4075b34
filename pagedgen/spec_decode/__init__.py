"""Speculative decoding (vLLM's ``speculative_config``): its configuration (``config``), the n-gram
proposer (``ngram``) and the per-sequence plan/commit/back-off (``speculator``) in the driver, the
verify rows of the target step (``verify``), the checks of a draft model against the target before
it loads (``draft_checks``), and the draft model (``draft_model``: its KV cache and proposals;
``early_exit`` writes a self-speculative draft). The accept/reject rule lives with the
sampler (``pagedgen/sample/rejection_sampler.py``). See docs/speculative.md."""
from pagedgen.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
