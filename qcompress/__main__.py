"""`python -m qcompress ...` runs the `qcompress` command line."""

import sys

from .cli import main

sys.exit(main())
