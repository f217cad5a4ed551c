"""Hugging Face integration: causal language models from ``transformers`` as pipeline layers (``CausalLM``).

May import: ``contract``, ``layout`` (meta-device materialization) (and Lightning, torch; ``transformers`` only when a model is wrapped).
"""

from .causal_lm import CausalLM, TypedDecoderLayer

__all__ = ["CausalLM", "TypedDecoderLayer"]
