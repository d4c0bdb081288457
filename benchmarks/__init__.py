"""Benchmarks: export/compile timings and serving load tests (importable so tests reach them)."""
