"""pagedgen: offline batch generation with LLMs over a paged KV cache (PagedAttention).

The API follows vLLM's offline one, so switching is one import::

    from pagedgen import LLM, SamplingParams
"""
from pagedgen.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedgen.engine.llm_engine import LLMEngine
from pagedgen.llm import LLM
from pagedgen.lora.request import LoRARequest
from pagedgen.outputs import CompletionOutput, RequestOutput
from pagedgen.pooling_outputs import (
    ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput,
    ScoringOutput, ScoringRequestOutput,
)
from pagedgen.pooling_params import PoolerConfig, PoolingParams
from pagedgen.sampling_params import SamplingParams
from pagedgen.structured_output.params import StructuredOutputsParams

__all__ = [
    "LLM",
    "LLMEngine",
    "LoRARequest",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "PoolingParams",
    "PoolerConfig",
    "PoolingOutput",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]
__version__ = "0.1.0"
