#!/usr/bin/env python
"""Generate text with minfer_jax from the command line: a thin wrapper around
`minfer_jax.cli.generate`.

    python scripts/generate.py -p "def fibonacci(n):" -n 64 --temp 0
    python scripts/generate.py --chat                  # interactive chat
    python scripts/generate.py --help

Installed, the same CLI is the `minfer-generate` command.
"""

import os
import sys

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # run from a checkout

from minfer_jax.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
