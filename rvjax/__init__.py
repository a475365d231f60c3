"""rvjax: a pure-JAX/XLA LLM inference runtime.

Einsum legend used throughout: B batch, T query tokens, S key tokens, D model, N query heads,
K kv heads, G query heads per kv head, H head dim, F ffn, V vocab.
"""

from rvjax.engine.llm import LLM, EngineConfig
from rvjax.engine.outputs import CompletionOutput, RequestOutput
from rvjax.sampling import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
