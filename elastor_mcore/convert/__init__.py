"""Offline conversion between the elastor zarr format and other checkpoint formats:
Megatron-Core ``torch_dist`` (``torch_dist``) and Hugging Face Llama (``hf_llama``).

Converters run in one process and hold one tensor at a time (``zarr_io``).
"""
