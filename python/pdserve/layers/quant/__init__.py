"""Quantized weight formats: how a checkpoint's quantized tensors load and run (``fp8``: block-scaled FP8)."""
