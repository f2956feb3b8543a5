"""Files shipped inside the package: built-in model presets (config + tokenizer, no weights).

Regenerate them with ``python tools/make_presets.py``.
"""

from __future__ import annotations

from pathlib import Path

PRESETS_ROOT = Path(__file__).resolve().parent / "presets"
# tiny-llama-eagle: an EAGLE draft for tiny-llama (--speculative-draft-model-path), not a servable target
PRESET_NAMES = ("tiny-llama", "tiny-qwen3-moe", "tiny-deepseek", "tiny-deepseek-fp8", "tiny-qwen3-fp8",
                "tiny-llama-eagle", "tiny-deepseek-v32", "tiny-deepseek-v32-fp8",
                "tiny-deepseek-v4",
                "tiny-deepseek-v4-fp4")


def preset_dir(name: str) -> Path:
    """Directory of preset ``name`` (loadable with ``from_pretrained``)."""
    if name not in PRESET_NAMES:
        raise ValueError(f"unknown preset {name!r}; built-in presets are {', '.join(PRESET_NAMES)}")
    return PRESETS_ROOT / name
