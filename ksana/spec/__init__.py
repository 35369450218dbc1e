"""Speculative decoding: drafters that propose tokens, and the counters of how many the model accepts.

The engine side lives where each part belongs: the scheduler budgets a request's drafts into its row
(``BatchScheduler``), the model runner verifies them (``ksana.worker.verify``), and the scheduler's update takes
the accepted tokens and rolls the rest back.
"""
