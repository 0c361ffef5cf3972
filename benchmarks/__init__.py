"""Benchmark scripts (run them as `python benchmarks/NAME.py`) and their shared helpers."""
