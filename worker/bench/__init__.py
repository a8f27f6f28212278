"""Benchmarks and tools; never imported by library code."""
