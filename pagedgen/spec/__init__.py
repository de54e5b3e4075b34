"""Speculative decoding (issue 34): its configuration, the n-gram proposer, the draft model (its KV
cache and proposals; an early-exit draft writer) and the rejection sampler. See
docs/speculative.md."""
from pagedgen.spec.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
