"""Benchmarks behind ``vmkv bench ...``: each returns a JSON-able dict and prints a table."""
