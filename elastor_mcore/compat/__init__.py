"""Shims that let Megatron-Core run where it was not written to run (``cpu``), and the
one place that decides how Megatron-Core versions differ (``mcore``: parallel-state
globals, ``ProcessGroupCollection``, where torch_dist keeps its common state)."""
