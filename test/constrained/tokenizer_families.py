"""Tiny tokenizers of each family a grammar backend must map to bytes, built offline in well under a
second and loadable by ``AutoTokenizer`` (what the engine's ``tokenizer_path`` takes):

- ``byte_level``: the presets' own byte-level BPE (GPT-2, Llama-3, Qwen, DeepSeek): every byte is
  one printable character, shifted past U+0100 where the byte is not printable;
- ``byte_fallback``: SentencePiece-style BPE (Llama-2, Mistral): a space is ``▁``, and bytes the
  pieces cannot spell are ``<0xNN>`` tokens, control characters among them;
- ``raw``: pieces are their own text, control characters included, with no byte shift
  (xgrammar's RAW vocabulary, as tiktoken's bytes are before any GPT-2 spelling).

Each keeps the presets' special ids (``<|bos|>`` 0, ``<|eos|>`` 1, ``<|pad|>`` 2) and stays under
tiny-llama's logits width, so the random-weight tiny-llama can decode with any of them."""

from __future__ import annotations

from pathlib import Path

from constrained.grammar_fixtures import PRESET_DIR

FAMILIES = ("byte_level", "byte_fallback", "raw")
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
# what the pieces are trained on: JSON-ish text, so the vocabulary holds multi-character pieces
# around quotes, braces and digits (a grammar must cut through them), and no control character
# (the byte-fallback family reaches those through <0xNN> alone)
CORPUS = [
    '{"color": "blue", "ok": false, "tag": "fox"}', '{"name": "ada", "age": 36, "tags": ["red", "green"]}',
    '[1, 2, 3.5, -7, 1e10, true, null]', "The quick brown fox jumps over the lazy dog.",
    '{"a": {"b": [{"c": "d"}]}, "e": "f\\n\\t\\"g\\""}', "ok: yes, no; maybe (42) - 3.14 = 0x1f",
] * 20
TRAINED_PIECES = 600


def build(family: str, directory: Path) -> Path:
    """Write the tokenizer of ``family`` into ``directory`` (returned); the presets' for byte_level."""
    if family == "byte_level":
        return PRESET_DIR
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if family == "byte_fallback":
        trainer_tok = Tokenizer(models.BPE())
        trainer_tok.normalizer = normalizers.Replace(" ", "▁")
        trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    elif family == "raw":
        trainer_tok = Tokenizer(models.BPE())
        trainer_tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_next")
    else:
        raise ValueError(f"family: {family!r} is not one of {FAMILIES}")
    alphabet = [chr(c) for c in range(33, 127)] + ["▁"]
    if family == "raw":
        alphabet = [chr(c) for c in range(0, 128)]  # every ASCII character is a piece, control ones too
    trainer = trainers.BpeTrainer(vocab_size=TRAINED_PIECES, initial_alphabet=alphabet, show_progress=False,
                                  limit_alphabet=len(alphabet))
    trainer_tok.train_from_iterator(CORPUS, trainer)
    trained = json_model(trainer_tok)
    pieces = sorted(trained["vocab"], key=trained["vocab"].get)
    head = SPECIALS + ([f"<0x{b:02X}>" for b in range(256)] if family == "byte_fallback" else [])
    vocab = {p: i for i, p in enumerate(head + [p for p in pieces if p not in head])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    if family == "byte_fallback":
        tk = Tokenizer(models.BPE(vocab, merges, unk_token=None, byte_fallback=True, fuse_unk=False))
        tk.normalizer = normalizers.Replace(" ", "▁")
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
        tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        tk = Tokenizer(models.BPE(vocab, merges))
        tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_next")
        tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=SPECIALS[0], eos_token=SPECIALS[1],
                                   pad_token=SPECIALS[2], clean_up_tokenization_spaces=False)
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return directory


def json_model(tk) -> dict:
    import json

    return json.loads(tk.to_str())["model"]
