"""Job control: launching the processes (``launcher``), ending the job together on a failure or a signal
(``watchdog``, ``guard``), and resuming a training epoch where a checkpoint left it (``resume``).

May import: ``_private``.
"""
