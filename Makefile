.PHONY: protos check-protos test
protos:
	python scripts/gen_protos.py
check-protos:
	python scripts/gen_protos.py --check
test:
	python -m pytest -q
