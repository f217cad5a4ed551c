"""What a model's own layers call to run under bfpp: the public names of the model contract's helpers.

A LightningModule becomes pipelinable through ``PipelineHooks``; its layers may also need:

- **context parallel** (each rank holds 1/cp of every sequence): ``attention`` (scaled dot-product attention over
  the whole sequence's keys and values, gathered over the context-parallel group; plain SDPA otherwise) and
  ``token_positions`` (this rank's tokens' positions in the whole sequence);
- **packed documents** (batches with document ids): ``split_documents``, ``document_positions`` (positions restarting
  at each document) and ``document_causal_mask`` (attention within each document);
- **a router's load-balancing loss** over the whole step (mixtures of experts): ``router_stats`` (a layer's routing
  statistics), ``router_loss`` (the loss a micro-batch trains, read from the step's totals in backward),
  ``load_balancing_loss`` (the loss of given statistics), ``active_step_totals`` (the step's totals; None outside
  a pipelined step) and ``step_aux_loss`` (the router loss a step trained, from its totals: to log it);
- **counted losses**: ``mean_loss`` turns a ``(loss_sum, num_items)`` pair into its mean;
- **a tensor-parallel plan** (``pipeline_tp_plan``) beside torch's ``ColwiseParallel`` / ``RowwiseParallel``:
  ``sequence_parallel_norm`` (a norm on the rank's sequence shard), ``sequence_gather`` / ``sequence_scatter``
  (whole sequence from / to shards at a module's input or output), ``replicated_output`` (a module's output made
  whole on every tensor-parallel rank) and ``whole_block`` (a block the plan keeps whole, e.g. a mixture of experts
  under expert x tensor parallel, computed on the gathered sequence).

The example GPT (``examples/gpt.py``) uses each of them. Their definitions live in ``lightning_bfpp.contract``; the
names here are the stable ones.
"""

from __future__ import annotations

from .contract.context_parallel import attention, token_positions
from .contract.documents import document_causal_mask, document_positions, split_documents
from .contract.hooks import PipelineHooks, mean_loss
from .contract.router_loss import load_balancing_loss, router_loss, router_stats, step_aux_loss
from .contract.step_totals import active_step_totals
from .layout.tensor_parallel import replicated_output, sequence_gather, sequence_parallel_norm, sequence_scatter
from .layout.tp_styles import whole_block

__all__ = ["PipelineHooks", "active_step_totals", "attention", "document_causal_mask", "document_positions",
           "load_balancing_loss", "mean_loss", "replicated_output", "router_loss", "router_stats",
           "sequence_gather", "sequence_parallel_norm", "sequence_scatter", "split_documents", "step_aux_loss",
           "token_positions", "whole_block"]
