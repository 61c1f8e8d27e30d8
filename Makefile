# The README's two commands: `make demo` and `make test`. Both create/update .venv first.
PYTHON ?= python3.12
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
OUT    ?= out
export HF_HUB_OFFLINE := 1

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

# The main job on an embedded default: a small synthetic LeRobot dataset (kept once made; the orbit
# scene, whose actions follow what the camera sees), its latent cache (pool encoder), a few hundred
# CPU training steps of the tiny WanVA (configs/tiny_cpu.toml) with a quarter of the episodes held
# out, the packed == per-episode check on the trained weights, forecasts of the held-out episodes
# against the last-action and mean-action baselines, then the sampler statistics.
# One OpenMP thread: the tiny model's ops are too small for a thread pool.
demo: $(STAMP)
	@mkdir -p $(OUT)
	@test -d $(OUT)/demo-data || $(BIN)/flexpack make-dataset $(OUT)/demo-data --episodes 24 --scene orbit
	$(BIN)/flexpack encode --dataset $(OUT)/demo-data
	rm -rf $(OUT)/demo-run
	OMP_NUM_THREADS=1 $(BIN)/flexpack train configs/tiny_cpu.toml --set data.root=$(OUT)/demo-data \
	    --set runtime.out_dir=$(OUT)/demo-run --set data.val_fraction=0.25 --set schedule.steps=300
	OMP_NUM_THREADS=1 $(BIN)/flexpack verify configs/tiny_cpu.toml --set data.root=$(OUT)/demo-data \
	    --checkpoint $(OUT)/demo-run
	OMP_NUM_THREADS=1 $(BIN)/flexpack sample $(OUT)/demo-run --checkpoint $(OUT)/demo-run --val \
	    --out $(OUT)/demo-run/samples
	@echo "action plot: $$(ls $(OUT)/demo-run/samples/*_actions.png | head -n 1)"
	$(BIN)/flexpack stats --frames-file data/episode_frames_ref.txt --mode pack \
	    --max-tokens 65536 --tokens-per-frame 36 --world-size 8 --plot $(OUT)/stats_pack.png
	$(BIN)/flexpack stats --frames-file data/episode_frames_ref.txt --mode pad \
	    --batch-size 4 --pool-factor 50 --pad-multiple 8 --world-size 8 --plot $(OUT)/stats_pad.png

# CPU test suite (GPU tests skip themselves without CUDA; slow ones run too, within ~15 min).
test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .hypothesis
