"""Loading a preset's tokenizer: a prompt longer than the tokenizer's model_max_length is not a
transformers warning (pdserve checks prompts against the context length itself: a 400)."""

from __future__ import annotations

import logging

from pdserve.assets import preset_dir
from pdserve.engine.tokenizer import load_tokenizer


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_prompt_past_model_max_length_is_tokenized_without_a_warning():
    path = preset_dir("tiny-llama")
    assert '"model_max_length": 4096' in (path / "tokenizer_config.json").read_text()  # what would warn
    tokenizer = load_tokenizer(path)
    seen = Records()
    library = logging.getLogger("transformers")  # transformers logs there, not to the root logger
    library.addHandler(seen)
    try:
        ids = tokenizer.encode("word " * 5000)
    finally:
        library.removeHandler(seen)
    assert len(ids) > 4096
    assert not [r for r in seen.records if r.levelno >= logging.WARNING], [r.getMessage() for r in seen.records]
