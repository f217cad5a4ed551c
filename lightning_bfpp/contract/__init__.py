"""What a LightningModule defines to be pipelined (``hooks``: ``PipelineHooks``, its layers, loss, inputs, and the
checks that a module meets it), what its methods' source says bfpp would run differently from one process
(``source_notes``), and how one of its layers is called (``layer_io``: side inputs, what may cross a stage boundary).

May import: nothing else of the package (torch and Lightning only): every other part builds on it.
"""
