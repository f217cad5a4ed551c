"""Job control: launching the processes (``launcher``), ending the job together on a failure or a signal
(``watchdog``, ``guard``), saving on a stop signal at a step boundary the ranks agree on (``preempt``), and resuming
a training epoch where a checkpoint left it (``resume``).

May import: ``_private``, ``checkpoint``.
"""
