"""`python -m minfer_jax.bench`: the same command line as scripts/bench.py."""

import sys

from minfer_jax.bench.cli import main

sys.exit(main())
