"""Running one rank's part of a schedule on its stages: the training and evaluation steps (``pipeline``), the
data-parallel gradient reduction (``grad_sync``), values and norms reduced over the mesh (``reduce``), and what a
step measures (``instrument``, ``measure``). Device-agnostic; no Lightning.

May import: ``schedule``, ``dims``, ``contract``, ``layout``, ``_private``.
"""
