"""Shims that let Megatron-Core run where it was not written to run."""
