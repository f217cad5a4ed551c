"""Where the model's parameters live: the strategy's layout as it is decided (``plan``), the device mesh (``mesh``),
the cut into looped stages (``cut``; by measured time: ``layer_cost``; the planner's pick: ``auto``) with its pieces:
the layers' names in the model (``names``), a stage's module (``stage_module``), the micro-batch's inputs on every
stage (``stage_inputs``), the placeholders of other ranks' layers (``remote``); and per stage tensor parallel (its
styles beyond torch's: ``tp_styles``), FSDP2 and tied-weight copies (``tensor_parallel``, ``fsdp``, ``tied``,
``stages``).

May import: ``schedule``, ``dims``, ``sim``, ``contract``, ``_private``.
"""
