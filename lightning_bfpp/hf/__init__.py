"""Hugging Face integration: causal language models from ``transformers`` as a pipelinable LightningModule
(``causal_lm``: ``CausalLM``), their layers (``layers``), the side inputs their own forward computes
(``side_inputs``), the checks made of a model at construction (``wrap_checks``), pretrained weights read per stage
(``pretrained``, with stored keys converted as transformers converts them: ``stored_keys``) and their tensor-parallel
plan (``tp_plan``, with ``tp_probe``: which weights the plan keeps whole compute with split heads), and LoRA
adapters of peft (``lora``).

May import: ``contract``, ``layout`` (meta-device materialization), ``checkpoint`` (what a checkpoint records of the
model, for its export as a Hugging Face directory) (and Lightning, torch; ``transformers`` only when a
model is wrapped).
"""

from .causal_lm import CausalLM
from .layers import TypedDecoderLayer

__all__ = ["CausalLM", "TypedDecoderLayer"]
