"""Speculative decoding (issue 34): its configuration, the n-gram proposer and the rejection
sampler. See docs/speculative.md for what is built and what is not yet."""
from pagedgen.spec.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
