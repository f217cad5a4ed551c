"""Hugging Face integration: causal language models from ``transformers`` as a pipelinable LightningModule
(``causal_lm``: ``CausalLM``), their layers (``layers``), the side inputs their own forward computes
(``side_inputs``), the checks made of a model at construction (``checks``), pretrained weights read per stage
(``pretrained``) and their tensor-parallel plan (``tensor_parallel``).

May import: ``contract``, ``layout`` (meta-device materialization) (and Lightning, torch; ``transformers`` only when a
model is wrapped).
"""

from .causal_lm import CausalLM
from .layers import TypedDecoderLayer

__all__ = ["CausalLM", "TypedDecoderLayer"]
