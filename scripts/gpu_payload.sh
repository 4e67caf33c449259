#!/usr/bin/env bash
# What the GPU check needs on a machine with no network (docs/gpu.md), made here:
#   .whl/  cp312 manylinux wheels of the project's imports the GPU image lacks, at the
#          versions this checkout's environment runs
#   .gpu/  the qwen-coder pair's configs and shared tokenizer, a 7B-class target's
#          config of the same family, the Spec-Bench dev questions, and the acceptance
#          the CPU bench measured for the real pair (specdec_tools/gpu/payload.py)
# Both folders are git-ignored; `run` carries them (carry: [".whl", ".gpu"]).
# Pulls the qwen-coder pair first if it is not pulled (1.6 GB, once).
#
#   scripts/gpu_payload.sh [--acceptance-from BENCH_JSON]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# The image has torch, transformers, numpy, grpcio and protobuf (older than the generated
# code needs: carried too), but none of these.
NAMES="grpcio protobuf grpcio-health-checking grpcio-reflection googleapis-common-protos gguf
opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
opentelemetry-instrumentation opentelemetry-instrumentation-grpc opentelemetry-exporter-otlp-common
opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-http-transport"
pins=$("$PYTHON" - $NAMES <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
except PackageNotFoundError as missing:
    sys.exit(f"gpu_payload: {missing} is not installed here; install the project first (README)")
PY
)
rm -rf .whl && mkdir -p .whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl $pins
"$PYTHON" -m specdec_tools.gpu.payload --out .gpu "$@"
echo "gpu_payload: .whl $(du -sh .whl | cut -f1) ($(ls .whl | wc -l) wheels), .gpu $(du -sh .gpu | cut -f1);" \
     "together $(du -csm .whl .gpu | tail -1 | cut -f1) MiB of the 64 MiB a device call carries"
