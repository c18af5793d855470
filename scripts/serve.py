#!/usr/bin/env python
"""Serve a model over an OpenAI-compatible HTTP API: a thin wrapper around `minfer_jax.server.cli`.

Usage:

    python scripts/serve.py -m MODEL --host 127.0.0.1 --port 8080 -np 8 -c 32768
    python scripts/serve.py --help
"""

import os
import sys

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # run from a checkout

from minfer_jax.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
