"""The only place that touches private torch, torchmetrics and Lightning APIs, and the version ranges they were
tested on (``versions``): Lightning's launcher and metric internals (``lightning_api``), torch's store and DTensor
internals (``torch_api``), torch.distributed.pipelining's schedule runtime (``pipelining``).

May import: ``schedule``, ``dims`` and ``contract`` (nothing above them).
"""
