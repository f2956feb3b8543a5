#!/usr/bin/env python3
"""Container health check: exit 0 when GET /health answers 200, else 1.

Used by the images' HEALTHCHECK and compose's healthchecks; the stdlib only, because the
images have neither curl nor wget. The URL is the first argument, else $PDSERVE_HEALTH_URL,
else the default port of ``pdserve up`` and ``pdserve serve`` on loopback.
"""

import os
import sys
import urllib.request

DEFAULT_URL = "http://127.0.0.1:30000/health"


def healthy(url: str, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:  # refused, timed out, or an HTTP error status (HTTPError is an OSError)
        return False


def main(argv: list[str]) -> int:
    url = argv[1] if len(argv) > 1 else os.environ.get("PDSERVE_HEALTH_URL", DEFAULT_URL)
    return 0 if healthy(url) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
