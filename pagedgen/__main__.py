"""``python -m pagedgen``: see pagedgen/cli.py."""
import sys

from pagedgen.cli import main

sys.exit(main())
