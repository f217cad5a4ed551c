"""The strategy's validation, test and predict steps (a mixin of ``BFPPStrategy``, as ``collectives``): the user's
step runs on the ranks holding the last stage (``steps``), its logs and result replayed on every rank, and the first
batch of every loop is compared across the ranks of a replica (``same_batch``)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..dims import DP, PP
from .same_batch import check_same_batch
from .steps import run_on_last_stage, user_step


class PipelineSteps:
    """Mixin for the strategy (needs its `runner`, `dims`, `device_mesh`, `precision_plugin`, `last_stage_step`
    and `_check_batch`)."""

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._user_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._user_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """What the user's predict_step returns, on every rank (shared over the pipeline group)."""
        return self._user_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _user_step(self, step: str, context: Callable, args: tuple, kwargs: dict) -> Any:
        assert self.runner is not None
        if self._check_batch:
            self._same_batch(kwargs.get("batch", args[0] if args else None), step.removesuffix("_step"))
        with context():
            return user_step(self.lightning_module, self.runner, step, args, kwargs, self._run_user_step)

    def _run_user_step(self, method: Callable[[], Any]) -> tuple[Any, list[str]]:
        """`method()` on the ranks holding the last stage; its logs replayed and its result returned on every
        rank (see ``lightning_bfpp.adapter.steps``)."""
        assert self.runner is not None
        pp_mesh, dp_mesh = self.device_mesh[PP], self.device_mesh[DP]

        def on_last_stage() -> Any:
            with self.last_stage_step():  # its barrier / broadcast over the ranks that run it
                return method()

        return run_on_last_stage(self.lightning_module, on_last_stage, self.runner.has_last_stage, pp_mesh.get_group(),
                                 self.dims.spec.pipeline_parallel - 1, dp_mesh.get_group(), self.root_device)

    def _same_batch(self, batch: Any, where: str) -> None:
        """The first batch of every loop and each measured training step: the same on the ranks of a replica."""
        self._check_batch = False
        check_same_batch(batch, where, self.dims, self.root_device)
