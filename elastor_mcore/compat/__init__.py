"""Shims that let Megatron-Core run where it was not written to run (``cpu``), the
one place that decides how Megatron-Core versions differ (``mcore``: parallel-state
globals, ``ProcessGroupCollection``, where torch_dist keeps its common state), and
torch's c10d rendezvous without the wait for a lost node's keep-alives
(``rendezvous``)."""
