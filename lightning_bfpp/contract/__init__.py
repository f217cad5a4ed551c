"""What a LightningModule defines to be pipelined (``hooks``: ``PipelineHooks``, its layers, loss, inputs, and the
checks that a module meets it), what its methods' source says bfpp would run differently from one process
(``source_notes``), how one of its layers is called (``layer_io``: side inputs, what may cross a stage boundary), and
the token batch format (``documents``: input ids, labels, and the document ids of packed windows).

May import: nothing else of the package (torch and Lightning only): every other part builds on it.
"""
