#!/usr/bin/env bash
# The GPU path's checks in one call (scripts/gpu_check.py prints the table):
# on a machine with CUDA they run with --device cuda; without, it says so in one
# line and runs the same checks with --device cpu. Installs nothing: run it from
# a checkout whose environment has specdec installed (python, or $PYTHON).
#
#   scripts/gpu_check.sh            # every check; about 8 minutes on a GPU
#   scripts/gpu_check.sh --quick    # the tiny pair's checks only (what CI runs)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if ! "$PYTHON" -c "import torch, specdec" 2>/dev/null; then
    echo "gpu_check: $PYTHON cannot import torch and specdec; install the project first (see README)" >&2
    exit 2
fi
if [ "$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))')" = 1 ]; then
    DEVICE=cuda
else
    DEVICE=cpu
    echo "gpu_check: no CUDA device here; running the same checks with --device cpu"
fi
exec timeout "${GPU_CHECK_TIMEOUT_S:-480}" "$PYTHON" scripts/gpu_check.py --device "$DEVICE" "$@"
