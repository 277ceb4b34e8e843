# Two commands do everything on a fresh machine:
#   make run    create the environment, then run the whole pipeline on the built-in synthetic data
#   make test   create the environment, then run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
# CPU machines take the CPU build of torch. Where this version's wheel is not local, set e.g.
#   TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
BIN := $(VENV)/bin

.PHONY: run test env clean
run: env
	$(BIN)/python -m pipeline run all

test: env
	$(BIN)/python -m pytest -q

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,notebooks]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

clean:
	rm -rf $(VENV) data/synthetic
