.PHONY: demo test setup

setup:
	bash scripts/setup.sh

demo: setup
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/python scripts/demo.py

test:
	bash scripts/test.sh
