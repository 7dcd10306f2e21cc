.PHONY: test setup lint bench
test:
	bash scripts/test.sh
setup:
	bash scripts/setup.sh
lint:
	.venv/bin/ruff check .
bench:
	.venv/bin/python bench/store_append.py
