"""What a LightningModule defines to be pipelined (``PipelineHooks``: its layers, loss, inputs) and how one of its
layers is called (``layer_io``: side inputs, what may cross a stage boundary).

May import: nothing else of the package (torch and Lightning only): every other part builds on it.
"""
