"""Job control: launching the processes (``launcher``; CPU threads per rank: ``threads``), ending the job together on
a failure or a signal (``watchdog``: the watch loop; ``posts``: what ranks post to the job's store; ``signals``: stop
signals handed to the watching thread; ``liveness``: local peers' processes; ``ending``: exit codes and the line saying
why; ``guard``: the strategy's part), saving on a stop signal at a step boundary the ranks agree on (``preempt``), and
resuming a training epoch where a checkpoint left it (``resume``).

May import: ``_private``, ``checkpoint``.
"""
