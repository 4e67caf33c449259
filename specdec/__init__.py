"""specdec core: what the drafter, verifier and coordinator share.

The three services import this package and never each other.
"""
__version__ = "0.1.0"
