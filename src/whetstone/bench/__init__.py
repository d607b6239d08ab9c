"""Benchmarks: each `run(...) -> dict` compares whetstone with a named baseline in one run."""
