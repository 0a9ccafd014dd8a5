"""`python -m tools`: the `planserve` command (tools/cli.py)."""

import sys

from tools.cli import main

sys.exit(main())
