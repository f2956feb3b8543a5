"""``python -m pdserve.bench_serving ...``: the same as ``pdserve bench ...`` (sglang's module name)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from pdserve.entrypoints.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
