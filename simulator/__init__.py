"""The scheduler simulator (``ksana simulate``, ``docs/simulator.md``): the engine's own scheduler and cache
manager on a virtual clock, with a simulated worker whose step latencies are fitted from perf mode's results.

``features`` (a step's shape) and ``latency_model`` (NNLS, held-out error) make ``fit``; ``profile`` reads perf
results; ``sweep`` writes the batches to profile; ``worker``, ``replay`` and ``simulate`` run a simulation and
``report`` summarises it in the load generator's schema; ``calibrate`` and ``validate`` set it against a real
server; ``cli`` is the command.
"""
