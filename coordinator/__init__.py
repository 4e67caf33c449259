"""The coordinator: the public Generate API; runs the speculative loop."""
