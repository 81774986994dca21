# The two commands of the README: `make demo` runs the main job, `make test` the suite.
# Each does its own set-up (.ci/setup); extra arguments go in ARGS="...".
.PHONY: demo test test-fast lint bench faults fuzz docs docs-serve

# The suite runs on pytest-xdist workers, split by tests/parallel.py (a file, or the whole
# contract suite, per unit of work); ARGS="-n0 ..." runs it serially, as a later -n wins.
PARALLEL = -n 3 --dist loadscope
# The fast tier: no server, fleet or fault (unit tests, the contract suite on memory).
FAST = -m "not server and not slow and not integration and not fault"

demo:
	./.ci/setup --venv-only
	.venv/bin/python -m jobfence demo $(ARGS)

test:
	./.ci/setup
	.venv/bin/python -m pytest -q $(PARALLEL) $(ARGS)

test-fast:
	./.ci/setup
	.venv/bin/python -m pytest -q $(PARALLEL) $(FAST) $(ARGS)

lint:
	./.ci/setup --venv-only
	.venv/bin/ruff check jobfence config locks tasks worker devstack tests
	.venv/bin/mypy

bench:
	./.ci/setup --venv-only
	.venv/bin/python -m jobfence bench locks $(ARGS)
	.venv/bin/python -m jobfence bench celery $(ARGS)

# Every fault row at full size, naive control beside jobfence, in one table (a few minutes).
faults:
	./.ci/setup --venv-only
	.venv/bin/python -m jobfence faults $(ARGS)

# The model-based test at length: FUZZ_EXAMPLES random sequences per lock backend (memory, Redis),
# nothing tolerated, failing sequences kept in .hypothesis/model for the next run.
FUZZ_EXAMPLES ?= 2000
fuzz:
	./.ci/setup --venv-only
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=0 \
		--hypothesis-show-statistics tests/model/test_model.py $(ARGS)

# The documentation site (mkdocs-material): `make docs` builds it strictly into site/ (any
# warning, broken link or missing anchor fails), `make docs-serve` serves it on 127.0.0.1:8000.
docs:
	./.ci/setup --venv-only
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=$(CURDIR) .venv/bin/mkdocs build --strict $(ARGS)

docs-serve:
	./.ci/setup --venv-only
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=$(CURDIR) .venv/bin/mkdocs serve --strict $(ARGS)
