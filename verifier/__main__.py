"""python -m verifier --model M --port P"""
from __future__ import annotations

import argparse

from specdec.runtime import torch_thread

torch_thread.spin_briefly()  # before torch loads: it shares the cores with the other model service

from specdec.service.cli_common import add_model_args, run_model_service

from verifier.service import serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m verifier", description="specdec verifier service")
    add_model_args(parser, default_quantize="none")
    run_model_service("verifier", parser.parse_args(argv), serve)


if __name__ == "__main__":
    main()
