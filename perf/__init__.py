"""Perf mode (``ksana perf``): the ModelPerfBackend replays fixed batches through the serving engine and writes
scheduling and operator latencies (``docs/perf_result.md``) for the simulator to fit.

``perf_config`` reads and checks the inputs, ``backend`` is the actor, ``operator_profiler`` times the model's ops,
``runner`` assembles a run, ``result_writer``/``csv_writer``/``stats`` write its outputs, ``cli`` is the command.
"""
