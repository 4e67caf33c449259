#!/usr/bin/env bash
# The GPU check in one call (docs/gpu.md): the services on the device, one table
# (specdec_tools/gpu/check.py), written as markdown and JSON to $OUT (or gpu_check_out/).
# On a machine with no network: first `scripts/gpu_payload.sh` where the pair is pulled,
# then carry .whl and .gpu; this installs the wheels into a folder of their own and runs
# the project from this checkout. Without CUDA it says so in one line and runs the same
# sections on the CPU on small shapes.
#
#   scripts/gpu_check.sh            # every section; about 7 minutes on an H200
#   scripts/gpu_check.sh --quick    # one acceptance, one prompt, few tokens (the test suite's)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
imports() { "$PYTHON" -c "import torch, specdec.runtime.models, coordinator.service" 2>/tmp/gpu_check_import.err; }
if ! imports && ls .whl/*.whl >/dev/null 2>&1; then
    # The environment lacks some of the project's imports (a GPU image): the carried wheels, in a folder of their own.
    SITE=${GPU_CHECK_SITE:-/tmp/specdec-site}
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || { echo "gpu_check: the carried wheels in .whl/ did not install" >&2; exit 2; }
    export PYTHONPATH="$SITE:$PYTHONPATH"
fi
if ! imports; then
    echo "gpu_check: $PYTHON cannot import the project: $(tail -1 /tmp/gpu_check_import.err)" >&2
    echo "gpu_check: install it (README), or carry the wheels scripts/gpu_payload.sh fetches (.whl/)" >&2
    exit 2
fi
if [ "$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))')" != 1 ]; then
    echo "gpu_check: no CUDA device here; running the same checks with --device cpu on small shapes"
fi
export PYTHONUNBUFFERED=1
exec timeout "${GPU_CHECK_TIMEOUT_S:-470}" "$PYTHON" -m specdec_tools.gpu.check "$@"
