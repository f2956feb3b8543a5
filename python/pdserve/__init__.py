"""pdserve: an LLM serving engine built around prefill/decode disaggregation."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import pdserve` stays light (no torch model code, no GPU packages).
    if name == "Engine":
        from pdserve.engine.thread_tuner import passive_waits_before_torch

        passive_waits_before_torch()  # before the import below loads torch (and OpenMP with it)
        from pdserve.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "__version__"]
