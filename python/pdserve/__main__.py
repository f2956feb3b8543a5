"""``python -m pdserve``: the same CLI as the ``pdserve`` console script."""

import sys

from pdserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
