# The README's two commands: `make demo` and `make test` (and `make test-slow`, the rest of the tests).
# All create/update .venv first.
PYTHON ?= python3.12
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
OUT    ?= out
export HF_HUB_OFFLINE := 1

.PHONY: demo test test-slow install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@echo "Installing flexpack into $(VENV)/ (first time only: pip downloads about 4.5 GB, mostly torch 2.11's"
	@echo "bundled CUDA libraries, which PyPI's Linux torch wheels always carry, even for a CPU demo; then"
	@echo "lerobot, diffusers, transformers. 5-15 min on a fast link; later runs skip this step)."
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# PYTHONWARNINGS: setuptools prints an informational "Editable installation" warning for every editable
	@# install (its import-path finder); it is not a problem and only alarms a first reader
	PYTHONWARNINGS=ignore $(BIN)/python -m pip install --progress-bar on -e ".[dev]"
	@touch $(STAMP)
	@echo "Installed. 'source $(VENV)/bin/activate' puts flexpack on PATH (the README's commands use it bare)."

# The main job on an embedded default: a small synthetic LeRobot dataset (kept once made; the orbit
# scene, whose actions follow what the camera sees), its latent cache (pool encoder), 200 CPU training
# steps of the small WanVA (configs/tiny_cpu.toml: 256 wide, what a 48-channel 2x2 video token needs;
# 200 of its steps cost what 300 of the 64-wide model did) with a quarter of the episodes held out, the
# packed == per-episode check on the trained weights, forecasts of the held-out episodes (4 samples each,
# a video of every one, plots of 2) against the last and mean baselines, then the sampler statistics of
# the demo's own episodes (geometry from its latent cache, as train derives it), the loss plot and a
# summary. One OpenMP thread: the model's ops are too small for a thread pool.
demo: $(STAMP)
	@mkdir -p $(OUT)
	@test -d $(OUT)/demo-data || $(BIN)/flexpack make-dataset $(OUT)/demo-data --episodes 24 --scene orbit
	$(BIN)/flexpack encode --dataset $(OUT)/demo-data
	rm -rf $(OUT)/demo-run
	OMP_NUM_THREADS=1 $(BIN)/flexpack train configs/tiny_cpu.toml --set data.root=$(OUT)/demo-data \
	    --set runtime.out_dir=$(OUT)/demo-run --set data.val_fraction=0.25 --set schedule.steps=200
	OMP_NUM_THREADS=1 $(BIN)/flexpack verify configs/tiny_cpu.toml --set data.root=$(OUT)/demo-data \
	    --checkpoint $(OUT)/demo-run
	OMP_NUM_THREADS=1 $(BIN)/flexpack sample $(OUT)/demo-run --checkpoint $(OUT)/demo-run --val \
	    --out $(OUT)/demo-run/samples --plots 2
	@echo "action plot: $$(ls $(OUT)/demo-run/samples/*_actions.png | head -n 1)"
	$(BIN)/flexpack stats --dataset $(OUT)/demo-data --mode pack --max-tokens 100 --plot $(OUT)/stats_pack.png
	$(BIN)/flexpack stats --dataset $(OUT)/demo-data --mode pad --batch-size 4 --pool-factor 2 \
	    --pad-multiple 4 --plot $(OUT)/stats_pad.png
	@$(BIN)/flexpack plot $(OUT)/demo-run
	@$(BIN)/python -m flexpack.commands.demo_summary $(OUT) --bin $(BIN)

# Lint (ruff, pyproject's [tool.ruff] rules), then the fast CPU tests, about 12 min on 2 cores (GPU tests skip
# themselves without CUDA). Tests marked `slow` (over ~12 s each: several processes, whole runs, compilation)
# are left to `make test-slow`.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow"

# The slow CPU tests alone (about 20 min on 2 cores; each test run compiles afresh in its own cache); CI runs them after `make test`.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .hypothesis
