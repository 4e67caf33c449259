"""The drafter service: a small (INT8) model that proposes tokens per session."""
