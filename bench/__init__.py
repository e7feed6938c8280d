"""Benchmarks and checks that are not tests: which script answers which question is in bench/README.md.

A package, so its scripts share helpers by plain imports: run them from the repository root as
`python -m bench.NAME [args]` (e.g. `.venv/bin/python -m bench.bench_core --quick`).
"""
