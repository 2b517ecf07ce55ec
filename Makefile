# Set-up and checks; see README.md. `make install` is idempotent: the stamp file is rebuilt only
# when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# cpu by default. GPU: Paddle 3's GPU wheels are not on PyPI (its paddlepaddle-gpu stops at 2.6.2). After
# installing CUDA, create the venv (python3 -m venv .venv) and install the paddlepaddle-gpu 3.x wheel for your
# CUDA into it from PaddlePaddle's own package index, with the pip command Paddle's install guide gives; then
# make install EXTRA=gpu, which finds it installed (alone, it fails: PyPI has no paddlepaddle-gpu>=3.0).
EXTRA ?= cpu

.PHONY: install demo test coverage dist-check bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[$(EXTRA),test]'
	# An editable install writes no bytecode, and with PYTHONDONTWRITEBYTECODE set every command would
	# compile nandoctor's ~50 modules again at start (0.3 s): compile them once here.
	$(BIN)/python -m compileall -q nandoctor > /dev/null
	touch $(STAMP)

# Both samples are broken on purpose: nandoctor exits 1 when it finds a fault, which is the demo working.
demo: install
	$(BIN)/nandoctor scan sample_configs/nan_in_data/config.yaml || echo "(scan exit status $$?: a fault was found, as this sample intends)"
	$(BIN)/nandoctor probe sample_configs/log_of_zero/config.yaml --steps 40 || echo "(probe exit status $$?: a fault was found, as this sample intends)"

# One worker per core (pytest-xdist); a test file's tests stay together on one worker, so the fixtures a file
# trains once are trained once (tests/conftest.py groups them; the parity file by sample config).
test: install
	$(BIN)/python -m pytest -n auto --dist loadgroup

coverage: install
	$(BIN)/python -m pytest -n auto --dist loadgroup --cov=nandoctor --cov-report=term:skip-covered

# The package as users get it. `python -m build` makes the sdist and, from it, the wheel, in an isolated build
# environment as pip does; the wheel goes with the cpu extra into a clean venv (no site packages, not this
# checkout: the commands run from the temporary folder), which runs --version, both demos and `nandoctor run`
# (the sitecustomize.py it ships). Then the sdist replaces the wheel there, and --version and the probe run
# again. The demos' configs are this checkout's sample_configs/ (they are not in the package); each finds its
# fault (exit 1 and its verdict in --json), which is the demo working. --no-compile: compiling Paddle's
# thousands of modules to bytecode was three quarters of the install (86-115 s against 26 s), for a venv used
# once. tests/test_packaging.py checks what the two files hold.
dist-check: install
	@set -e; d=$$(mktemp -d); trap 'rm -rf "$$d"' EXIT; \
	faults() { st=0; "$$@" > "$$d/out.txt" 2>&1 || st=$$?; \
		"$$d/venv/bin/python" -c 'import json, sys; v = json.load(open(sys.argv[1]))["verdict"]; assert v != "healthy", v' \
			"$$d/r.json" && test $$st -eq 1 || { cat "$$d/out.txt"; echo "dist-check: wanted exit 1 and a fault's verdict, got exit $$st: $$*"; exit 1; }; \
		rm "$$d/r.json"; echo "  exit 1, the fault it looks for: $$*"; }; \
	echo "dist-check: python -m build"; \
	$(BIN)/python -m build --outdir "$$d/dist" . > "$$d/build.log" 2>&1 || { tail -40 "$$d/build.log"; exit 1; }; \
	echo "dist-check: the wheel into a clean venv"; \
	$(PYTHON) -m venv "$$d/venv"; cd "$$d"; \
	venv/bin/python -m pip install -q --no-compile "$$(ls dist/*.whl)[cpu]"; \
	venv/bin/python -c 'import nandoctor, sys; assert nandoctor.__file__.startswith(sys.prefix), nandoctor.__file__'; \
	venv/bin/nandoctor --version; \
	faults venv/bin/nandoctor scan "$(CURDIR)/sample_configs/nan_in_data/config.yaml" --json r.json -q; \
	faults venv/bin/nandoctor probe "$(CURDIR)/sample_configs/log_of_zero/config.yaml" --steps 40 --json r.json -q; \
	faults venv/bin/nandoctor run --json r.json -q -- venv/bin/python "$(CURDIR)/examples/unmodified_loop.py"; \
	echo "dist-check: the sdist in place of the wheel"; \
	venv/bin/python -m pip uninstall -q -y nandoctor; \
	venv/bin/python -m pip install -q --no-compile "$$(ls dist/*.tar.gz)"; venv/bin/python -m pip check; \
	venv/bin/nandoctor --version; \
	faults venv/bin/nandoctor probe "$(CURDIR)/sample_configs/log_of_zero/config.yaml" --steps 40 --json r.json -q; \
	echo "dist-check: passed"

bench: install
	$(BIN)/python benchmarks/run.py

# ruff; the layers and the import rules of pyproject.toml's [tool.importlinter] (docs/architecture.md); no
# function, method or class above cyclomatic complexity 20 (xenon's rank C, radon's measure)
lint: install
	$(BIN)/ruff check nandoctor tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/xenon --max-absolute C nandoctor

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
