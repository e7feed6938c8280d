# The two set-up commands of the README: `make demo` (the main job) and `make test` (the tests).
.PHONY: setup demo test lint bench
setup:
	./scripts/setup.sh

demo: setup
	.venv/bin/spec-batch run examples/sample_batch.jsonl -o out/sample_results.jsonl --force

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

test: setup lint
	./scripts/services.sh
	./scripts/browser.sh
	.venv/bin/python -m pytest -q -n auto --maxprocesses 4  # one worker per core (pytest-xdist), at most 4

bench: setup
	.venv/bin/python -m bench.bench_core
