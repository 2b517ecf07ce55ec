# Set-up and checks; see README.md. `make install` is idempotent: the stamp file is rebuilt only
# when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# cpu by default; GPU users: make install EXTRA=gpu (after installing CUDA)
EXTRA ?= cpu

.PHONY: install demo test coverage bench lint clean

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
# trains once are trained once.
test: install
	$(BIN)/python -m pytest -n auto --dist loadfile

coverage: install
	$(BIN)/python -m pytest -n auto --dist loadfile --cov=nandoctor --cov-report=term:skip-covered

bench: install
	$(BIN)/python benchmarks/run.py

# ruff, then the layers and the import rules of pyproject.toml's [tool.importlinter] (docs/architecture.md)
lint: install
	$(BIN)/ruff check nandoctor tests benchmarks
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
