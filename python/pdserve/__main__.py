"""``python -m pdserve``: the same CLI as the ``pdserve`` console script (which starts here too)."""

import sys


def main() -> int:
    """The CLI, with a Ctrl-C during its imports (a second or more on a busy host) one line too."""
    try:
        from pdserve.entrypoints.cli import main as cli_main
    except KeyboardInterrupt:
        print("pdserve: interrupted", file=sys.stderr)
        return 130
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
