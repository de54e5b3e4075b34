"""``python -m pagedgen``: the command line (pagedgen/cli/, docs/cli.md)."""
import sys

from pagedgen.cli import main

sys.exit(main())
