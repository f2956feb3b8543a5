"""KV storage tiers below host memory: the ``PageStore`` contract, keys, the page format, backends.

``base.py`` holds the contract and ``create_page_store`` (backends by name, each imported when
chosen); ``keys.py`` the content keys; ``page_format.py`` the verified object format;
``file.py`` the NVMe tier; ``mooncake_store.py`` the Mooncake Store tier.
"""

from pdserve.mem.storage.base import BACKEND_NAMES, KEY_BYTES, STAT_NAMES, PageStore, create_page_store
from pdserve.mem.storage.keys import chunk_keys, namespace

__all__ = ["BACKEND_NAMES", "KEY_BYTES", "STAT_NAMES", "PageStore", "chunk_keys", "create_page_store", "namespace"]
