# The two commands of the README: `make demo` runs the main job, `make test` the suite.
# Each does its own set-up (.ci/setup); extra arguments go in ARGS="...".
.PHONY: demo test test-fast test-pythons lint bench faults fuzz docs docs-serve

# The suite runs on pytest-xdist workers, split by tests/parallel.py (a file, or the whole
# contract suite, per unit of work); ARGS="-n0 ..." runs it serially, as a later -n wins.
PARALLEL = -n 4 --dist loadscope
# The fast tier: no server, fleet or fault (unit tests, the contract suite on memory).
FAST_TIER = not server and not slow and not integration and not fault
FAST = -m "$(FAST_TIER)"
# The Pythons `make test` runs besides 3.11 (the whole suite), each in its own .venv-X.Y
# (.ci/setup --python X.Y): the fast tier and the selection marked `pythons` (tests/conftest.py,
# PYTHONS_SELECTION: README and docs examples, the model-based test, real workers, Django 6's
# own django.tasks), a few minutes each.
EXTRA_PYTHONS = 3.12 3.13

demo:
	./.ci/setup --demo
	.venv/bin/python -m jobfence demo $(ARGS)

# `make test` runs the whole suite on 3.11 as two pytest runs, each under 12 minutes on 2
# cores: the lock contract, the fleets, the faults and the model (LONG), then the rest. With
# ARGS (a selection, -n0, ...) it is one run, as asked.
LONG = tests/contract tests/faults tests/integration tests/model tests/workflows
# Failures reported as Python prints them: pytest's long form parses each frame's source
# with `ast`, which CPython 3.11 cannot do while another thread parses (a SystemError,
# "AST constructor recursion depth mismatch", that took a whole run down once).
REPORT = --tb=native

test:
	./.ci/setup
ifeq ($(strip $(ARGS)),)
	.venv/bin/python -m pytest -q $(PARALLEL) $(REPORT) $(LONG)
	.venv/bin/python -m pytest -q $(PARALLEL) $(REPORT) $(addprefix --ignore=,$(LONG))
else
	.venv/bin/python -m pytest -q $(PARALLEL) $(ARGS)
endif
	$(MAKE) --no-print-directory test-pythons

test-pythons:
	@set -e; for v in $(EXTRA_PYTHONS); do \
		start=$$(date +%s); ./.ci/setup --python $$v; set_up=$$(date +%s); \
		echo "==> Python $$v: the fast tier and the pythons selection"; \
		.venv-$$v/bin/python -m pytest -q $(PARALLEL) $(REPORT) -m "pythons or ($(FAST_TIER))" $(ARGS); \
		echo "==> Python $$v: set-up $$((set_up - start)) s, tests $$(($$(date +%s) - set_up)) s"; \
	done

test-fast:
	./.ci/setup
	.venv/bin/python -m pytest -q $(PARALLEL) $(FAST) $(ARGS)

lint:
	./.ci/setup --venv-only
	.venv/bin/ruff check jobfence config locks tasks worker devstack demo tests
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
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_TALLY=.hypothesis/model-tally .venv/bin/python -m pytest \
		-p no:cacheprovider --timeout=0 --hypothesis-show-statistics tests/model/test_model.py $(ARGS)
	@sort .hypothesis/model-tally | cut -d" " -f1 | uniq -c | sed 's/^/sequences checked: /'
	@rm -f .hypothesis/model-tally

# The documentation site (mkdocs-material): `make docs` builds it strictly into site/ (any
# warning, broken link or missing anchor fails), `make docs-serve` serves it on 127.0.0.1:8000.
docs:
	./.ci/setup --venv-only
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=$(CURDIR) .venv/bin/mkdocs build --strict $(ARGS)

docs-serve:
	./.ci/setup --venv-only
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=$(CURDIR) .venv/bin/mkdocs serve --strict $(ARGS)
