"""`python -m minfer_jax.server ...`: the server's command line (minfer_jax.server.cli)."""

import sys

from minfer_jax.server.cli import main

sys.exit(main())
