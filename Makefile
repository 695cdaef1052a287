# The two commands of the README: `make demo` (set up, then generate with the packaged model) and `make test`.
.PHONY: setup setup-test demo test

setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh test

demo: setup
	.venv/bin/nexttoken generate "Once upon a time" --max-new-tokens 120

test: setup-test
	.venv/bin/python -m pytest -q
