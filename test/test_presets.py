"""Built-in presets load offline with transformers and share one tokenizer."""

import json

import pytest

from pdserve.assets import PRESET_NAMES, preset_dir

transformers = pytest.importorskip("transformers")

ARCHS = {"tiny-llama": "LlamaForCausalLM", "tiny-qwen3-moe": "Qwen3MoeForCausalLM",
         "tiny-deepseek": "DeepseekV3ForCausalLM", "tiny-deepseek-fp8": "DeepseekV3ForCausalLM",
         "tiny-qwen3-fp8": "Qwen3ForCausalLM", "tiny-llama-eagle": "LlamaForCausalLMEagle",
         "tiny-deepseek-v32": "DeepseekV32ForCausalLM", "tiny-deepseek-v32-fp8": "DeepseekV32ForCausalLM",
         "tiny-deepseek-v4": "DeepseekV4ForCausalLM",
         "tiny-deepseek-v4-fp4": "DeepseekV4ForCausalLM"}
SPECIALS = {"<|bos|>": 0, "<|eos|>": 1, "<|pad|>": 2, "<|im_start|>": 3, "<|im_end|>": 4}


@pytest.fixture(scope="module", params=PRESET_NAMES)
def preset(request):
    d = preset_dir(request.param)
    tok = transformers.AutoTokenizer.from_pretrained(d, local_files_only=True)
    cfg = transformers.AutoConfig.from_pretrained(d, local_files_only=True)
    return request.param, tok, cfg


def test_unknown_preset_is_rejected():
    with pytest.raises(ValueError, match="tiny-llama"):
        preset_dir("tiny-gpt")


def test_config_matches_tokenizer(preset):
    name, tok, cfg = preset
    assert cfg.architectures == [ARCHS[name]]
    assert len(tok) <= cfg.vocab_size and cfg.vocab_size % 64 == 0
    assert cfg.vocab_size - len(tok) < 64
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == \
           (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert cfg.max_position_embeddings == 4096
    assert str(cfg.dtype).endswith("float32")


def test_special_tokens(preset):
    _, tok, _ = preset
    assert tok.convert_tokens_to_ids(list(SPECIALS)) == list(SPECIALS.values())
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    # Special tokens in text are one id each, never split into bytes.
    assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == 3


@pytest.mark.parametrize("text", [
    "The lighthouse keeper counted 112 steps.",
    "  leading spaces, tabs\tand\nnew lines  ",
    "Unicode: café, naïve, 你好, 🙂 — all bytes survive.",
    "",
])
def test_round_trip(preset, text):
    _, tok, _ = preset
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.encode(text) == ids  # no automatic BOS/EOS: the chat template frames prompts
    assert tok.decode(ids) == text
    assert all(0 <= i < len(tok) for i in ids)


def test_bpe_actually_merges(preset):
    _, tok, _ = preset
    text = "The morning market was full of bread, honey and music."
    assert len(tok.encode(text)) < len(text.encode()) / 2.5


def test_chat_template(preset):
    _, tok, _ = preset
    msgs = [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Hi there!"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye."}]
    body = ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye.<|im_end|>\n")
    assert tok.apply_chat_template(msgs, tokenize=False) == body
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == body + "<|im_start|>assistant\n"
    ids = tok.encode(prompt)
    assert ids.count(3) == 5 and ids.count(4) == 4 and ids[-3:] == tok.encode("<|im_start|>assistant\n")[-3:]
    assert tok.decode(ids) == prompt


def test_same_tokenizer_everywhere():
    files = {name: (preset_dir(name) / "tokenizer.json").read_bytes() for name in PRESET_NAMES}
    assert len(set(files.values())) == 1


def test_chat_template_travels_in_tokenizer_config():
    raw = json.loads((preset_dir("tiny-llama") / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in raw["chat_template"]


def test_size_fields():
    cfg = {n: transformers.AutoConfig.from_pretrained(preset_dir(n), local_files_only=True)
           for n in PRESET_NAMES}
    ll = cfg["tiny-llama"]
    assert (ll.hidden_size, ll.num_hidden_layers, ll.num_attention_heads, ll.num_key_value_heads,
            ll.intermediate_size, ll.head_dim) == (256, 4, 8, 4, 688, 32)
    qm = cfg["tiny-qwen3-moe"]
    assert (qm.hidden_size, qm.num_hidden_layers, qm.num_attention_heads, qm.num_key_value_heads,
            qm.head_dim, qm.num_experts, qm.num_experts_per_tok, qm.moe_intermediate_size) == \
           (128, 4, 4, 2, 32, 16, 4, 128)
    ds = cfg["tiny-deepseek"]
    assert (ds.hidden_size, ds.num_hidden_layers, ds.num_attention_heads, ds.q_lora_rank, ds.kv_lora_rank,
            ds.qk_rope_head_dim, ds.qk_nope_head_dim, ds.v_head_dim, ds.n_routed_experts,
            ds.num_experts_per_tok, ds.n_shared_experts, ds.n_group, ds.topk_group,
            ds.first_k_dense_replace, ds.moe_intermediate_size, ds.intermediate_size) == \
           (128, 4, 4, 64, 64, 16, 32, 32, 16, 4, 1, 4, 2, 1, 128, 384)
    assert ds.rope_parameters["rope_type"] == "yarn"


def test_model_builds_from_config(preset):
    torch = pytest.importorskip("torch")
    _, tok, cfg = preset
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.tensor([tok.encode("Hello there.")])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()
