"""`python -m minfer_bench.bench`: the same command line as scripts/bench.py."""

import sys

from minfer_bench.bench.cli import main

sys.exit(main())
