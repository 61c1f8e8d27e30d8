"""Parallelism applied to a plain model from outside: FSDP2 and compilation (``parallelize``),
float8 matmuls, selective activation checkpointing."""
