"""The user's LightningModule as Lightning runs it under bfpp: its own steps and logs (``steps``, ``step_state``),
its collectives (``collectives``), precision and gradient hand-over to Lightning's backward (``precision``,
``handover``), the loader checks (``same_batch``, ``loader``), NaN handling (``nonfinite``), the reporting
callbacks (``metrics``, ``trace``) and Lightning's own output made true of a bfpp run (``lightning_output``).

May import: ``schedule``, ``dims``, ``sim``, ``contract``, ``layout``, ``runtime``, ``_private``.
"""
