# Set-up and every routine job. `make demo` and `make test` run `make setup` first.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
DATA := data/openmoji
RUN := runs/demo

.PHONY: setup demo test test-unit test-slow deepspeed img2dataset gpu-bundle gpu-rehearsal openmoji-all noto lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,demo]'
	touch $(STAMP)

# Idempotent: reinstalls only when pyproject.toml or constraints.txt changed; always (re)seeds the
# Hugging Face cache so the demo's Hub ID resolves offline.
setup: $(STAMP)
	$(BIN)/python -m mmpretrain.hub_cache

demo: setup
	@start=$$(date +%s); set -e; \
	$(BIN)/python -m data_tools build demo:openmoji --out $(DATA) --image-size 64 --shard-size 100 --overwrite; \
	$(BIN)/python -m data_tools embed $(DATA) --model sentence-transformers/all-MiniLM-L6-v2; \
	rm -rf $(RUN); \
	$(BIN)/python -m mmpretrain.train --config configs/demo.yaml; \
	$(BIN)/python -m mmpretrain.eval --model $(RUN) --dataset $(DATA) $(DATA)/test \
	    --task zeroshot_classification zeroshot_retrieval --output $(RUN)/results.json; \
	$(BIN)/python -m mmpretrain.export $(RUN) --out $(RUN)/export > /dev/null; \
	$(BIN)/python scripts/reports/demo_table.py --from $(RUN)/results.json; \
	echo "demo done in $$(( $$(date +%s) - start )) s: results in $(RUN)/results.json, export in $(RUN)/export"

# On 2 pytest-xdist workers, one per core (one torch thread each): a module's tests on one worker, in
# tests/conftest.py's order (FIRST), the session's data and 2-rank launch made once for both (conftest's shared)
test: setup
	$(BIN)/python -m pytest -m "not slow" -q -n 2 --dist loadscope --no-loadscope-reorder --durations=50

# The unit tier (~40 s): no built data, training run, launcher or server (tests/conftest.py marks them)
test-unit: setup
	$(BIN)/python -m pytest -m unit -q -n 2 --dist loadscope --no-loadscope-reorder

test-slow: setup deepspeed img2dataset
	$(BIN)/python -m pytest -m slow -q

# DeepSpeed for the slow engine test (tests/test_engines.py), on its CPU accelerator: an sdist, built
# against the venv's torch (no build isolation, which would fetch an unpinned torch), no compiled ops,
# in its own folder so that the rest of the suite runs without it.
DEEPSPEED := .cache/deepspeed
$(DEEPSPEED)/.installed: constraints.txt
	DS_BUILD_OPS=0 DS_ACCELERATOR=cpu $(BIN)/pip install --quiet --disable-pip-version-check --no-build-isolation \
	    --no-deps --target $(DEEPSPEED) deepspeed==0.19.8 hjson==3.1.0 ninja==1.13.2 msgpack==1.2.4 py-cpuinfo==9.0.0 \
	    einops==0.8.2
	touch $@

deepspeed: setup $(DEEPSPEED)/.installed

# img2dataset for the CC3M download path (scripts/pretrain_cc3m.sh; its slow test): in its own venv,
# since it pins pandas<3 and brings wandb, opencv and albumentations, none of which this project needs.
IMG2DATASET := .cache/img2dataset
$(IMG2DATASET)/.installed:
	test -x $(IMG2DATASET)/bin/python || $(PY) -m venv $(IMG2DATASET)
	$(IMG2DATASET)/bin/pip install --quiet --disable-pip-version-check img2dataset==1.47.0
	touch $@

img2dataset: $(IMG2DATASET)/.installed

# The OpenMoji evidence bed (demo:openmoji-all, data_tools/demo.py): every named OpenMoji emoji at 64 px, labelled by
# Unicode subgroup, embedded with MiniLM, plus data/openmoji-all/noto/, its held-out emoji drawn by Google's
# Noto (Apache-2.0). `make noto` fetches npm's emoji-datasource-google@16.0.0 (74 MB download; 3,786
# 64-px PNGs and emoji.json kept, 22 MB) into .cache/noto: the only step here that needs npm.
OPENMOJI_ALL := data/openmoji-all
NOTO := .cache/noto/emoji-datasource-google-16.0.0
$(NOTO)/.unpacked:
	mkdir -p $(NOTO)
	cd $(NOTO) && npm pack --silent emoji-datasource-google@16.0.0 > /dev/null && \
	    tar xzf emoji-datasource-google-16.0.0.tgz package/emoji.json package/LICENSE package/img/google/64 && \
	    rm emoji-datasource-google-16.0.0.tgz
	touch $@

noto: $(NOTO)/.unpacked

openmoji-all: setup noto
	$(BIN)/python -m data_tools build demo:openmoji-all --out $(OPENMOJI_ALL) --image-size 64 --shard-size 500 \
	    --second-style $(NOTO) --overwrite
	$(BIN)/python -m data_tools embed $(OPENMOJI_ALL) --model sentence-transformers/all-MiniLM-L6-v2

# What scripts/bench/bench_gpu.sh needs on a GPU machine without network: cp312 wheels of the dependencies its
# image may lack and a small embedded OpenMoji dataset, ~35 MiB in .cache/gpu-bundle (PyPI access here).
gpu-bundle: setup
	PYTHON=$(BIN)/python scripts/bench/gpu_bundle.sh .cache/gpu-bundle

# The GPU check's CPU path under the device image's versions (Python 3.12, torch 2.11.0, transformers 5.17.0,
# ...: scripts/bench/device_image.txt) with the cp312 bundle installed over them as on the device; ~2 min
# once the venv exists (~3 GB from PyPI the first time). gpu.json in bench_results/rehearsal/.
gpu-rehearsal: gpu-bundle
	scripts/bench/gpu_rehearsal.sh

# Every scripts/bench/bench_*.py, each writing bench_results/<name>.json (slow: minutes each), then docs/performance.md's table.
bench: setup
	for f in scripts/bench/bench_*.py; do $(BIN)/python $$f || exit 1; done
	$(BIN)/python scripts/reports/perf_table.py --write

lint: setup
	$(BIN)/ruff check mmpretrain data_tools tests scripts

clean:
	rm -rf $(VENV) data runs
