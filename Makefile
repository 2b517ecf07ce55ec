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

.PHONY: install demo test bench lint clean

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

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python benchmarks/run.py

lint: install
	$(BIN)/ruff check nandoctor tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
