#!/usr/bin/env python3
"""llama-bench compatible benchmark for minfer_jax (model tests pp/tg/pg, or --kernels).

Thin entry point: the logic lives in minfer_bench/bench/ (cli.py). Run `python scripts/bench.py
--help`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minfer_bench.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
