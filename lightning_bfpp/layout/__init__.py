"""Where the model's parameters live: the strategy's layout as it is decided (``plan``), the device mesh (``mesh``),
the cut into looped stages (``partition``; by measured time: ``layer_cost``; the planner's pick: ``auto``), and per
stage tensor parallel, FSDP2 and tied-weight copies (``tensor_parallel``, ``fsdp``, ``tied``, ``stages``).

May import: ``schedule``, ``sim``, ``contract``, ``_private``.
"""
