"""`python -m specdec_tools.bench`: the same as `specdec bench`."""
import sys

from specdec_tools.bench import main

sys.exit(main())
