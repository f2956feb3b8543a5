"""Model implementations by HF architecture name (``registry``) and weight loading (``loader``)."""
