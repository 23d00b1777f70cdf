"""`python -m cuvil`: the same command line as the `cuvil` script."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
