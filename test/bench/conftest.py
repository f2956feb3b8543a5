import os
import sys

# The server helpers live with the HTTP server's tests; the benchmark's tests start the same servers.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "entrypoints"))
