"""A service process kept waiting with its imports done, for `specdec up`'s next
restart of that service: `python -m specdec_tools.standby MODULE` imports
`MODULE.__main__` (torch and transformers, for a model service: about 3 s of the
tiny pair's restart), then reads one line, the service's arguments as a JSON
list, and runs `MODULE.__main__.main` with them. A restart then costs the
service's load and warm-up alone. An empty line (the launcher went away, or
stopped the stack) ends it without serving anything."""
from __future__ import annotations

import importlib
import json
import sys


def main() -> int:
    module = sys.argv[1]
    entry = importlib.import_module(f"{module}.__main__")
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    args = json.loads(line)
    sys.argv = [f"python -m {module}", *args]
    entry.main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
