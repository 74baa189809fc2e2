"""`python -m bulletserve.cli` runs the `bullet` command."""

import sys

from bulletserve.cli import main

sys.exit(main())
