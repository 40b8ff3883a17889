"""Benchmarks that ship with the package (``grpo-fast bench ...``) and their measurement helpers."""
