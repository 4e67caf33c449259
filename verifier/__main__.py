"""python -m verifier --model M --port P"""
from __future__ import annotations

from specdec.runtime import torch_thread

torch_thread.spin_briefly()  # before torch loads: it shares the cores with the other model service

from specdec.service.cli_common import run_model_service
from specdec.service.settings import model_service_parser

from verifier.service import serve


def main(argv: list[str] | None = None) -> None:
    run_model_service("verifier", model_service_parser("verifier").parse_args(argv), serve)


if __name__ == "__main__":
    main()
