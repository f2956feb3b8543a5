"""``python -m pdserve.launch_server --model-path ...``: SGLang's entry point, same as ``pdserve serve``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from pdserve.entrypoints.cli import main as cli_main

    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
