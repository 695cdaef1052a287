"""`python -m nexttoken ...` is the `nexttoken` command."""

import sys

from .cli import main

sys.exit(main())
