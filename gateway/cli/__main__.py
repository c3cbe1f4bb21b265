"""`python -m gateway.cli ...`: the `loraplex` command."""

import sys

from gateway.cli import main

if __name__ == "__main__":  # imported (not run) by tools that walk every module
    sys.exit(main())
