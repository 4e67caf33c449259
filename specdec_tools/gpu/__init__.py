"""The GPU check (scripts/gpu_check.sh, docs/gpu.md): what a GPU user needs to
know of the services, measured in one call on a machine with no network.

  payload.py   what travels there, made here: configs, the shared tokenizer, questions
  shapes.py    the models of the check, built from configs with random weights
  steps.py     one model's synchronized step times, launches and GPU-busy time, in process
  services.py  the real services on those models: target-only, spec by γ at synthetic acceptances
  check.py     the sections in turn within a time budget, one table (markdown and JSON)
"""
