# The README's two commands: `make demo` and `make test`. Both create/update .venv first.
PYTHON ?= python3.12
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
OUT    ?= out
export HF_HUB_OFFLINE := 1

.PHONY: demo test test-all install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

demo: $(STAMP)
	@mkdir -p $(OUT)
	$(BIN)/flexpack stats --frames-file data/episode_frames_ref.txt --mode pack \
	    --max-tokens 65536 --tokens-per-frame 36 --world-size 8 --plot $(OUT)/stats_pack.png
	$(BIN)/flexpack stats --frames-file data/episode_frames_ref.txt --mode pad \
	    --batch-size 4 --pool-factor 50 --pad-multiple 8 --world-size 8 --plot $(OUT)/stats_pad.png

# CPU test suite (GPU tests skip themselves without CUDA; slow ones run too, within ~15 min).
test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .hypothesis
