"""The user-facing contract. A LightningModule opts into pipelining by defining these hooks
(inherit `PipelineHooks` for the defaults and docs, or define them by duck typing)."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .documents import is_token_batch, token_batch_inputs
from .layer_io import LayerCall, compute_side_inputs, describe_structure, no_side_inputs, side_inputs_of

LossValue = torch.Tensor | tuple[torch.Tensor, torch.Tensor | int]


def loss_parts(value: LossValue) -> tuple[torch.Tensor, torch.Tensor | int | None]:
    """(loss, num_items) of a ``pipeline_loss`` result: ``(loss_sum, num_items)`` as it is; a plain loss (a mean) with
    None."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2 or not isinstance(value[0], torch.Tensor):
            raise TypeError(f"pipeline_loss returned {describe_structure(value)}: return a scalar loss (a mean), or "
                            "(loss_sum, num_items): the sum of the counted items' losses and how many there are.")
        return value[0], value[1]
    return value, None


def mean_loss(value: LossValue) -> torch.Tensor:
    """A ``pipeline_loss`` result as one process's mean over its batch: ``loss_sum / num_items`` for a
    ``(loss_sum, num_items)`` pair, a plain loss as it is. For steps that run the model whole (a ``training_step``
    under ``strategy="auto"``, a ``validation_step``)."""
    loss, items = loss_parts(value)
    return loss if items is None else loss / items


class PipelineHooks:
    """Mixin describing how bfpp cuts a LightningModule into pipeline stages.

    Required:
        ``pipeline_layers()``: the model as an ordered list of submodules of ``self``; layer ``i``'s
        output (a tensor or tuple of tensors) is layer ``i+1``'s input. Stages are contiguous runs of
        layers, so parameter names stay the model's own (``blocks.3.attn.weight`` everywhere).
        ``pipeline_loss(output, target)``: the loss of one micro-batch from the last layer's output, in one of two
        forms. ``(loss_sum, num_items)``: the sum of the losses of the items the loss counts (e.g. the targets that
        are not ignored, -100) and how many there are; bfpp then trains the mean over every counted item of the
        whole global batch (all micro-batches, data-parallel replicas and accumulated batches), as one process does
        on that batch, and logs that mean as ``train_loss``. A plain scalar: a mean per micro-batch (like
        ``F.cross_entropy``), averaged over micro-batches and replicas; the same as one process only when every
        micro-batch counts the same number of items. ``mean_loss`` turns either form into the one-process mean.

    Optional:
        ``pipeline_inputs(batch)``: ``(inputs, target)`` from a batch; default: ``batch`` is ``(x, y)``, ``(x,)``, the
        tensor ``x`` (target None: prediction), or a token batch {"input_ids", "labels", "document_ids"}
        (``contract.documents``: inputs ``(input_ids, document_ids)`` for packed documents). ``inputs``
        (a tensor or a flat tuple of tensors) are the first layer's arguments; when the module computes side inputs,
        a first layer whose forward takes fewer positional arguments gets the leading ones, and the others (document
        ids) reach ``pipeline_side_inputs`` only.
        ``pipeline_side_inputs(inputs)``: a dict of values every layer may need besides its input (position ids,
        rotary cos/sin, an attention mask), computed once per micro-batch on every stage from that micro-batch's
        ``inputs``; each layer whose ``forward`` takes a keyword of that name (or ``**kwargs``) receives it, so
        layers such as Hugging Face decoder layers are listed as they are. Nothing of it crosses stages.
        ``pipeline_uses_step_totals`` (an attribute): True for a loss with a router loss (``contract.router_loss``,
        through the step's totals): the strategy then picks its definition (``router_loss``: the whole step's where
        the schedule runs every forward before the first backward, else each micro-batch's own, said once) and refuses,
        before launch, ``router_loss="batch"`` under a schedule that starts a backward before the step's last forward.
        Another loss reading ``contract.step_totals`` in backward fails there at its first read, naming the schedule.
        ``pipeline_train_metrics``, ``pipeline_step_logs``, ``pipeline_tp_plan``, ``pipeline_context_parallel``: the
        methods below, used only where the module defines them (a subclass's override, or a method of that name on a
        module that does not inherit this mixin).
        ``pipeline_init_weights(name, module)``: initializes one module of a model built on the meta device, on the
        ranks holding it; default ``module.reset_parameters()``.

    Your ``validation_step``, ``test_step`` and ``predict_step`` run as written on the last stage's ranks, with
    ``self(x)`` returning the pipeline's output; ``training_step`` is replaced by the pipeline (``pipeline_loss``).
    """

    def pipeline_layers(self) -> Sequence[nn.Module]:
        raise NotImplementedError("define pipeline_layers() to return the model's ordered layers")

    def pipeline_loss(self, output: Any, target: Any) -> torch.Tensor:
        raise NotImplementedError("define pipeline_loss(output, target) to return a micro-batch's loss")

    def pipeline_inputs(self, batch: Any) -> tuple[Any, Any]:
        if is_token_batch(batch):  # {"input_ids", "labels", "document_ids"}: contract.documents
            return token_batch_inputs(batch)
        if isinstance(batch, torch.Tensor):  # inputs alone (e.g. a prediction loader): no target
            return batch, None
        # (inputs,) from TensorDataset(x), or (inputs, target)
        if isinstance(batch, (tuple, list)) and len(batch) in (1, 2):
            return batch[0], batch[1] if len(batch) == 2 else None
        raise TypeError(
            f"the default pipeline_inputs(batch) takes a batch (inputs, target), (inputs,) or an inputs tensor; got "
            f"{describe_structure(batch)}: define pipeline_inputs(batch) -> (inputs, target) on {type(self).__name__}."
        )

    pipeline_side_inputs = no_side_inputs

    def pipeline_init_weights(self, name: str, module: nn.Module) -> None:
        """Initialize `module`'s own parameters and buffers (``name``: its qualified name in this LightningModule),
        which bfpp just gave uninitialized memory: the model was built on the meta device. Called only for this
        rank's stages, under a seed per module (``lightning_bfpp.layout.materialize``). Default:
        ``reset_parameters()``."""
        default_init(name, module)

    # Optional hooks: documented here, used only where a module defines its own (``defined_hook``).

    def pipeline_train_metrics(self, output: Any, target: Any) -> None:
        """Called once per training step on the rank(s) holding the last stage, with the step's last-stage output
        (micro-batches concatenated, detached) and target; what it logs with ``self.log`` reaches every rank, as from
        ``training_step``. Defining it keeps those outputs until the step ends (for a language model: the logits of
        the whole batch)."""

    def pipeline_step_logs(self) -> None:
        """Called once per training step, after its backward, on the rank(s) holding the last stage; what it logs
        with ``self.log`` reaches every rank. For values of the whole step that a loss computes from
        ``contract.step_totals`` (``CausalLM`` logs its router loss, ``train_aux_loss``)."""

    def pipeline_tp_plan(self, layer_name: str, layer: nn.Module, tensor_parallel: int,
                         sequence_parallel: bool = False) -> dict | None:
        """Needed for ``BFPPStrategy(tensor_parallel>1)``: for each layer (``layer_name`` as in stage names), a dict
        {submodule name or ``*`` pattern inside ``layer``, or "" for the layer itself: torch ``ParallelStyle``}
        applied with ``parallelize_module`` over the tensor-parallel group, or None to keep it whole. Each layer must
        return its output whole (end a column-wise split with a row-wise one, or gather it). With
        ``sequence_parallel=True`` (asked only of a hook that takes the argument) every layer gets a plan, and between
        layers each tp rank holds its 1/tp of the sequence (dim 1): the first layer's output is cut into shards, the
        last gathers them, norms run on shards (``lightning_bfpp.modeling``: ``sequence_gather``,
        ``sequence_parallel_norm``, ``sequence_scatter``). Raise naming the setting when the model cannot split by
        ``tensor_parallel`` (e.g. heads); a weight tied to another module cannot be split. Not defined: tensor
        parallel is refused, naming this hook."""
        return None

    def pipeline_context_parallel(self, layer_name: str, layer: nn.Module, context_parallel: int) -> bool:
        """Needed for ``BFPPStrategy(context_parallel>1)``: True for each layer that computes right on a shard of
        every sequence (its attention through ``lightning_bfpp.modeling.attention``, its positions from
        ``token_positions``); a layer it does not vouch for (False, or an exception saying why) is refused before
        launch, named. Not defined: context parallel is refused, naming this hook."""
        return False

    def pipeline_forward(self, inputs: Any) -> Any:
        """Run all layers in order — the unpipelined forward, for use in ``forward``/``training_step`` (side
        inputs computed once and passed as under bfpp)."""
        fn = side_inputs_of(self)
        side = compute_side_inputs(fn, inputs) if fn is not None else None
        out = inputs
        for i, layer in enumerate(self.pipeline_layers()):
            call = LayerCall(layer, f"pipeline_layers()[{i}]")
            if i == 0 and fn is not None:
                out = call.leading_inputs(out)
            args, kwargs = call.arguments(out, side)
            out = layer(*args, **kwargs)
        return out


def defined_hook(module: Any, name: str) -> Callable | None:
    """`module`'s optional hook `name` (bound) where the module defines one of its own; None where it has none or
    only ``PipelineHooks``' documented default."""
    hook = getattr(module, name, None)
    if not callable(hook) or getattr(hook, "__func__", None) is getattr(PipelineHooks, name, None):
        return None
    return hook


def own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters and buffers `module` holds itself (not its children's)."""
    yield from module.named_parameters(recurse=False, remove_duplicate=False)
    yield from ((n, b) for n, b in module.named_buffers(recurse=False, remove_duplicate=False) if b is not None)


def default_init(name: str, module: nn.Module) -> None:
    """``module.reset_parameters()`` (torch's layers define it); a module holding tensors without one is an error:
    its memory would stay uninitialized."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
    elif any(True for _ in own_tensors(module)):
        held = ", ".join(n for n, _ in own_tensors(module))
        raise TypeError(
            f"{name or 'the root module'} ({type(module).__name__}) holds {held} and has no reset_parameters(), so "
            "bfpp cannot initialize it after building it on the meta device. Define reset_parameters() on "
            f"{type(module).__name__}, or pipeline_init_weights(name, module) on the LightningModule "
            "(docs/adapting.md: Models larger than one process)."
        )


def built_in_configure_model(module: nn.Module) -> bool:
    """Whether `module` lists no layers before its ``configure_model`` runs (then every rank checks it in ``setup``,
    not the launching process before the others start)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not is_overridden("configure_model", module):
        return False
    try:
        return not list(module.pipeline_layers())
    except Exception:  # e.g. an attribute that configure_model sets
        return True


REQUIRED_HOOKS = ("pipeline_layers", "pipeline_loss")


def check_hooks(module: nn.Module) -> None:
    """Raise a TypeError naming the missing hook when `module` cannot be pipelined."""
    for hook in REQUIRED_HOOKS:
        fn = getattr(module, hook, None)
        base = getattr(PipelineHooks, hook)
        if fn is None or getattr(fn, "__func__", None) is base:
            raise TypeError(
                f"strategy='bfpp' needs `{type(module).__name__}.{hook}()`: "
                "see lightning_bfpp.PipelineHooks for the contract (docs/adapting.md)."
            )


def check_module(module: nn.Module, precision: str, loss_scaling: bool) -> None:
    """Raise naming the setting when strategy='bfpp' cannot honour `module` as written: a missing hook, manual
    optimization, a `training_step(dataloader_iter)`, or fp16 (`precision`; `loss_scaling`: a grad scaler)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    check_hooks(module)
    name = type(module).__name__
    if not module.automatic_optimization:
        raise ValueError(
            f"{name}.automatic_optimization=False: strategy='bfpp' runs forward and backward of every micro-batch "
            "itself inside the training step, so a manual optimization loop cannot run; use automatic "
            "optimization (return the loss, or let bfpp compute it with pipeline_loss) or another strategy."
        )
    if is_overridden("training_step", module) and (
            "dataloader_iter" in inspect.signature(module.training_step).parameters):
        raise ValueError(f"{name}.training_step(dataloader_iter): strategy='bfpp' needs one batch per step; take "
                         "`batch`.")
    check_precision(precision, loss_scaling)


def check_precision(precision: str, loss_scaling: bool = False) -> None:
    """Raise naming the bf16 precisions for fp16 (`precision` "16-mixed" / "16-true", or a grad scaler: `loss_scaling`).
    Also run by Trainer(...) itself, before Lightning's own check of ModelParallelStrategy's precisions (which
    suggests "16-true"): ``_private.lightning_api.check_precision_first``."""
    if loss_scaling or str(precision).startswith("16"):
        raise ValueError(
            f"precision={precision!r}: strategy='bfpp' does not support fp16 (no loss scaling across pipeline "
            "stages; fp16 overflows within steps); use precision='bf16-mixed' or 'bf16-true' (or '32-true')."
        )


def describe_contract(module: nn.Module) -> str:
    """One line saying which of the user's methods bfpp runs as written and which the pipeline replaces."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    name = type(module).__name__
    metrics = "pipeline_train_metrics(output, target)" if defined_hook(module, "pipeline_train_metrics") \
        else "none (define pipeline_train_metrics(output, target) to log training metrics)"
    replaced = (f"{name}.training_step is not run: " if is_overridden("training_step", module) else "") + \
        "each training step runs the pipeline schedule with pipeline_loss per micro-batch and logs train_loss"
    as_written = [m for m in ("validation_step", "test_step", "predict_step") if is_overridden(m, module)]
    return (f"bfpp: {replaced}; training metrics: {metrics}; run as written on the last stage with self(x) = the "
            f"pipeline's output: {', '.join(as_written) or 'none'} (docs/adapting.md).")


def check_callbacks(callbacks: list) -> None:
    """Raise naming a callback strategy='bfpp' cannot honour: StochasticWeightAveraging copies the whole module
    before the model is cut and pairs its parameters with this rank's stages in order (wrong weights, or a shape
    error), then runs a forward outside the pipeline; Lightning refuses it for FSDP and DeepSpeed likewise."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    if any(isinstance(c, StochasticWeightAveraging) for c in callbacks):
        raise ValueError(
            "StochasticWeightAveraging does not work under strategy='bfpp': it keeps a copy of the whole model and "
            "pairs its parameters with this rank's pipeline stages in order (Lightning refuses it for sharded "
            "strategies too). Average weights in a callback of your own over pl_module.parameters() (each rank "
            "holds its own stages), or use strategy='auto'/'ddp' for SWA.")


def training_batch(module: nn.Module, batch: Any) -> tuple[Any, Any]:
    """(inputs, target) of a training batch by the module's ``pipeline_inputs``; a batch of inputs alone under the
    default hook is refused, naming the fix."""
    inputs, target = module.pipeline_inputs(batch)
    if target is None and getattr(type(module), "pipeline_inputs", None) is PipelineHooks.pipeline_inputs:
        raise ValueError(f"a training batch of {type(module).__name__} holds inputs only: strategy='bfpp' trains on "
                         "(inputs, target) batches (pipeline_loss(output, target)); return both from the training "
                         "loader, or define pipeline_inputs(batch) -> (inputs, target).")
    return inputs, target
