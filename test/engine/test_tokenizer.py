"""Loading a preset's tokenizer: a prompt longer than the tokenizer's model_max_length is not a
transformers warning (pdserve checks prompts against the context length itself: a 400); a
tokenizer declared generic loads as AutoTokenizer would load it, without importing torch."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from pdserve.assets import PRESETS_ROOT, preset_dir
from pdserve.engine.tokenizer import GENERIC_TOKENIZER_MODEL_TYPES, load_tokenizer

PRESETS = sorted(p.name for p in PRESETS_ROOT.iterdir() if (p / "tokenizer_config.json").is_file())
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo <|im_end|> wörld"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": CITY}}]


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


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_tokenizer_is_the_one_auto_tokenizer_loads(preset):
    """The torch-free path picks AutoTokenizer's class and gives its ids, chat prompts and text."""
    from transformers import AutoTokenizer

    path = preset_dir(preset)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(auto)
    text = "héllo <|im_end|> wörld  \n\t 12345"
    assert ours.encode(text) == auto.encode(text)
    for kw in ({"add_generation_prompt": True}, {"tools": TOOLS, "add_generation_prompt": True}):
        prompt = auto.apply_chat_template(CHAT, tokenize=False, **kw)
        assert ours.apply_chat_template(CHAT, tokenize=False, **kw) == prompt
    ids = auto.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (auto.eos_token_id, auto.bos_token_id, len(auto))


def test_generic_model_types_are_ones_whose_declared_class_transformers_keeps():
    """transformers replaces a declared generic tokenizer class for some model types (qwen2 is one):
    such a type on the torch-free path would load a different tokenizer than AutoTokenizer."""
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )

    assert not GENERIC_TOKENIZER_MODEL_TYPES & MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    for model_type in GENERIC_TOKENIZER_MODEL_TYPES:
        assert (TOKENIZER_MAPPING_NAMES.get(model_type) or "") != "MistralCommonBackend", model_type
    preset_types = {json.loads((preset_dir(p) / "config.json").read_text())["model_type"] for p in PRESETS}
    assert preset_types <= GENERIC_TOKENIZER_MODEL_TYPES  # every preset takes the torch-free path


def test_a_tokenizer_of_another_model_type_loads_through_auto_tokenizer(tmp_path):
    """A qwen2 directory declaring the generic class gets what AutoTokenizer picks (not the generic one)."""
    from transformers import AutoTokenizer

    src = preset_dir("tiny-llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen2",
                                                      "architectures": ["Qwen2ForCausalLM"]}))
    ours, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ours) is type(auto) and type(auto).__name__ != "TokenizersBackend"


def _imports_torch(code: str) -> bool:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print('torch' in sys.modules)"],
                         capture_output=True, text=True, env=env, timeout=120, check=True)
    return out.stdout.split()[-1] == "True"


def test_the_frontend_modules_and_the_router_tokenizer_do_not_import_torch():
    """torch costs seconds of CPU per process: the HTTP frontend's and the router's modules, and the
    router's (and frontend's) tokenizer, import none of it (a regression here shows at once)."""
    assert not _imports_torch("import pdserve.entrypoints.http_server, pdserve.router.app, pdserve.entrypoints.up")
    assert not _imports_torch(f"from pdserve.router.prompt_tokens import load_local_tokenizer, prompt_ids\n"
                              f"tok = load_local_tokenizer({str(preset_dir('tiny-llama'))!r})\n"
                              "assert prompt_ids(tok, '/v1/chat/completions', {'messages': [{'role': 'user', "
                              "'content': 'hi'}]})")
    assert _imports_torch("import pdserve.engine.sampler")  # the check can see torch imported
