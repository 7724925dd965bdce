"""``python -m fsdp2.plan``: the planner's command line (``_cli.main``)."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
