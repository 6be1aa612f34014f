# Quick start: `make demo` and `make test`. Both create .venv (and build Horovod) on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.parallax_setup/ready

.PHONY: setup demo test plan clean

setup: $(STAMP)

$(STAMP): tools/setup.sh setup.py parallax_tf/native/bind_shim.c $(wildcard parallax_tf/ops/*.cc parallax_tf/ops/*.h)
	bash tools/setup.sh
	touch $(STAMP)

# The main job: the LSTM language model on 2 local ranks, Parallax hybrid strategy.
demo: $(STAMP)
	$(PY) -m models.lm --np 2 --strategy hybrid --steps 60 --log_every 10

plan: $(STAMP)
	$(PY) -m models.lm --plan_only --np 2

test: $(STAMP)
	$(PY) -m pytest -q --durations=40 tests

clean:
	rm -rf $(VENV) build *.egg-info
