#!/usr/bin/env bash
# The GPU check rehearsed here, in the GPU image's own software (docs/gpu.md): its Python
# minor version and its torch build (the CUDA one, which runs on the CPU), transformers and
# numpy at its versions (the device library's KINDS.md), and the project's other imports
# only from the wheels scripts/gpu_payload.sh fetches, installed by gpu_check.sh as there.
# Run it before a GPU session: an API that moved between torch versions, or a step that
# only looks slow on a CPU, costs nothing to find here. Needs a package index (5 GB once).
#
#   scripts/gpu_rehearsal.sh [gpu_check.sh's arguments]     # the table in $OUT or gpu_check_out/
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=${REHEARSAL_ENV:-/tmp/specdec-gpu-image}
PYTHON_312=${PYTHON_312:-$(command -v python3.12 || true)}
IMAGE_PINS="torch==2.11.0 transformers==5.17.0 numpy==2.5.2 tokenizers==0.23.2 safetensors==0.8.0
accelerate==1.15.0 huggingface_hub==1.33.0 prometheus-client matplotlib psutil filelock tqdm jinja2
sentencepiece scipy wrapt requests packaging pyyaml"
if [ ! -x "$ENV/bin/python" ]; then
    [ -n "$PYTHON_312" ] || { echo "gpu_rehearsal: no python3.12 here (PYTHON_312=...): the image runs 3.12" >&2; exit 2; }
    "$PYTHON_312" -m venv "$ENV"
    # The image's torch is 2.11: a constraint file capping torch elsewhere does not apply to it.
    PIP_CONSTRAINT= "$ENV/bin/pip" install --quiet $IMAGE_PINS
fi
ls .whl/*.whl >/dev/null 2>&1 && [ -d .gpu/tokenizer ] || scripts/gpu_payload.sh
rm -rf "$ENV-site"   # the carried wheels, installed afresh by gpu_check.sh as on the GPU machine
PYTHON="$ENV/bin/python" GPU_CHECK_SITE="$ENV-site" exec scripts/gpu_check.sh "$@"
