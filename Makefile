# Two commands do everything on a fresh machine:
#   make run    create the environment, then run the whole pipeline on the built-in synthetic data
#   make test   create the environment, then lint the code and run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
# CPU machines take the CPU build of torch. Where this version's wheel is not local, set e.g.
#   TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
BIN := $(VENV)/bin

.PHONY: run test env serve-env clean
run: env
	$(BIN)/python -m pipeline run all

# Two workers: much of the suite waits on the servers, clusters and ranks it starts.
test: env
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2

env: $(VENV)/.installed serve-env

# The server's environment: the tritonserver bundled with nvidia-pytriton, and the served models'
# Python. Triton's python-backend stub is built against numpy 1.x and receives zeros from numpy 2,
# so the models run here (numpy<2), found through PATH (export/environment.py).
# pyarrow 26 requires numpy 2, hence <26.
# On a GPU machine the models take the CUDA torch that $(PYTHON) already has (it stays behind this
# environment's own packages on sys.path):   make serve-env MODELS_TORCH=system
# Without network access, from wheels (tools/offline-wheels.sh):   PIP_OPTIONS="--no-index --find-links DIR"
TRITON_VENV  ?= .venv-triton
MODELS_TORCH ?= pip
PIP_OPTIONS  ?=
MODELS_PIP   := $(TRITON_VENV)/bin/python -m pip install -q $(PIP_OPTIONS)
serve-env: $(TRITON_VENV)/.installed

$(TRITON_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(TRITON_VENV)
	$(MODELS_PIP) --upgrade pip setuptools
ifeq ($(MODELS_TORCH),system)
	$(PYTHON) -c "import pathlib, sys, torch; pathlib.Path(sys.argv[1]).write_text(str(pathlib.Path(torch.__file__).parent.parent) + '\n')" \
	  "$$($(TRITON_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/system-torch.pth"
	$(MODELS_PIP) "numpy>=1.24,<2" "pandas>=2.2,<2.3" "pyarrow>=15,<26" "pyyaml>=6" "tqdm>=4.60"
else
	$(MODELS_PIP) $(TORCH_INDEX) "$(TORCH_SPEC)" "numpy>=1.24,<2" "pandas>=2.2,<2.3" "pyarrow>=15,<26" "pyyaml>=6" "tqdm>=4.60"
endif
	$(MODELS_PIP) --no-deps -e .
	# the server binary and python-backend stubs; its own dependencies are client-side, not needed here
	$(MODELS_PIP) --no-deps "nvidia-pytriton>=0.7,<0.8"
	touch $@

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,notebooks]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

clean:
	rm -rf $(VENV) $(TRITON_VENV) data/synthetic
