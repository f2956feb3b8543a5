"""Strict-parser fuzz of json_schema outputs in the engine: a random-weight tiny-llama (it writes the
worst strings a grammar lets through: control bytes, lone escapes, odd whitespace) samples 1,000
outputs per tokenizer family (the presets' byte-level BPE, a SentencePiece-style byte-fallback one,
a raw-piece one: constrained/tokenizer_families.py) at temperatures 0.7-1.2 with a seed each, in
batches of 128, over schemas with nested objects, arrays, bounded numbers, enums, min/maxLength
strings, patterns and optional fields. Every output ends by the grammar (finish_reason stop),
passes json.loads and jsonschema.validate, and is compact (the default): no whitespace but one
space after ':' and ','. The other backends get a smaller share on the same footing."""

from __future__ import annotations

import json
import random

import pytest

import pdserve
from constrained.grammar_fixtures import FUZZ_MAX_TOKENS, FUZZ_SCHEMAS, check_json, without_bounds
from constrained.json_lexer import compact_spacing
from constrained.tokenizer_families import FAMILIES, build

PROMPTS = ["Give me a record:", "Once upon a time", "1, 2, 3,", "{", "The answer is", '"\\u00', "\t\n"]
BATCH = 128
# (backend, family) -> samples: xgrammar (the default) the full share on every family; llguidance
# has no raw-piece vocabulary (refused: test/constrained/test_json_strings.py)
SAMPLES = {("xgrammar", f): 1000 for f in FAMILIES}
SAMPLES.update({("llguidance", "byte_level"): 200, ("llguidance", "byte_fallback"): 200,
                ("outlines", "byte_level"): 200, ("outlines", "byte_fallback"): 200})


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {f: str(build(f, root / f)) for f in FAMILIES}


def _requests(n: int, seed: int, backend: str = "xgrammar") -> tuple[list[str], list[dict], list[str]]:
    rng = random.Random(seed)
    # outlines-core does not bound integers (docs/structured-outputs.md): a bounded integer of its need not end
    schemas = [name for name, schema in FUZZ_SCHEMAS.items()
               if backend != "outlines" or without_bounds(schema) == schema]
    names = [schemas[i % len(schemas)] for i in range(n)]
    params = [{"max_new_tokens": FUZZ_MAX_TOKENS, "temperature": rng.uniform(0.7, 1.2), "seed": rng.getrandbits(32),
               "json_schema": json.dumps(FUZZ_SCHEMAS[name])} for name in names]
    return [rng.choice(PROMPTS) for _ in range(n)], params, names


@pytest.mark.parametrize("backend, family", list(SAMPLES))
def test_every_sample_is_strict_json_valid_under_its_schema(tokenizer_dirs, backend, family):
    engine = pdserve.Engine(model_path="tiny-llama", tokenizer_path=tokenizer_dirs[family], grammar_backend=backend,
                            max_running_requests=BATCH, random_seed=sum(map(ord, family)))
    try:
        prompts, params, names = _requests(SAMPLES[backend, family], len(backend) * 31 + len(family), backend)
        outs = engine.generate(prompt=prompts, sampling_params=params)
    finally:
        engine.shutdown()
    lengths = []
    for out, name in zip(outs, names):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (name, out["text"], out["meta_info"])
        check_json(out["text"], name, backend)
        assert compact_spacing(out["text"]), out["text"]
        lengths.append(out["meta_info"]["completion_tokens"])
    # the walks are not trivial: the model wrote strings, numbers and arrays of many lengths
    assert len(set(out["text"] for out in outs)) > len(outs) // 2 and max(lengths) > 2 * min(lengths)
