"""``python -m pdserve.router ...``: the same as ``pdserve router ...``."""

import sys

from pdserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["router", *sys.argv[1:]]))
