"""Regenerate pdserve's built-in model presets (configs + tokenizer, no weights).

    python tools/make_presets.py            # rewrite python/pdserve/assets/presets/*
    python tools/make_presets.py --check    # also reload each preset and build its model

Offline and deterministic: the byte-level BPE tokenizer is trained on
``tools/tokenizer_corpus.txt`` (prose written for this repo), and every config
size field is set explicitly because transformers' defaults are full-size models.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

# Single-threaded training: merge ties must not depend on thread scheduling.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tools" / "tokenizer_corpus.txt"
PRESETS_DIR = REPO / "python" / "pdserve" / "assets" / "presets"

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]  # ids 0..4
TARGET_VOCAB = 2000
VOCAB_MULTIPLE = 64  # config vocab is padded so embedding rows tile evenly across TP ranks
MAX_POSITIONS = 4096

# ChatML, as Qwen's templates write it: with ``tools`` a system turn lists them (Hermes-style, the
# format --tool-call-parser qwen25 reads) and an assistant turn's calls are rendered as <tool_call>
# blocks; ``enable_thinking`` false closes an empty thinking part after the generation prompt, as
# Qwen3's does. Without tools, tool calls or enable_thinking, the text is plain ChatML, unchanged.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- if message['tool_calls'] is defined %}{%- for call in message['tool_calls'] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# YaRN as DeepSeek-V3 ships it, scaled down: 1024 trained positions stretched 4x to 4096.
_YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
              "original_max_position_embeddings": MAX_POSITIONS // 4,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

# DeepSeek-V3's quantization_config: FP8 weights with one scale per [128, 128] block.
_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

# preset name -> (architecture, size fields); shared fields are added in preset_config().
PRESETS = {
    "tiny-llama": ("LlamaForCausalLM", dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, rope_parameters=_DEFAULT_ROPE,
        attention_bias=False, mlp_bias=False)),
    "tiny-qwen3-moe": ("Qwen3MoeForCausalLM", dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=128, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        use_sliding_window=False, rope_parameters=_DEFAULT_ROPE, attention_bias=False)),
    "tiny-deepseek": ("DeepseekV3ForCausalLM", dict(
        hidden_size=128, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=16,
        num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, num_mtp_layers=0, rope_interleave=True,
        rope_parameters=_YARN_ROPE, attention_bias=False)),
    # EAGLE draft for tiny-llama (--speculative-algorithm EAGLE): one Llama layer, tiny-llama's
    # hidden size and KV shape (its KV shares the target's pool); SGLang's architecture name.
    "tiny-llama-eagle": ("LlamaForCausalLMEagle", dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, rope_parameters=_DEFAULT_ROPE,
        attention_bias=False, mlp_bias=False)),
}
# FP8 twins: the shapes above (dense Qwen3 here, so q/k/v start on 128-row blocks), quantized
# like the checkpoints they stand for; tiny-deepseek-fp8 also declares DeepSeek-V3's MTP layer.
PRESETS |= {
    "tiny-deepseek-fp8": (PRESETS["tiny-deepseek"][0], dict(
        PRESETS["tiny-deepseek"][1], num_mtp_layers=1, quantization_config=_FP8)),
    "tiny-qwen3-fp8": ("Qwen3ForCausalLM", dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, use_sliding_window=False, rope_parameters=_DEFAULT_ROPE,
        attention_bias=False, quantization_config=_FP8)),
}
# DeepSeek-V3.2: tiny-deepseek's shapes plus DSA's lightning indexer; an index_topk of 32 so that
# prompts past 32 tokens attend to a strict subset of their tokens.
PRESETS |= {
    "tiny-deepseek-v32": ("DeepseekV32ForCausalLM", dict(
        {k: v for k, v in PRESETS["tiny-deepseek"][1].items() if k not in ("num_mtp_layers", "rope_interleave")},
        index_topk=32, index_head_dim=32, index_n_heads=4)),
}
# Its FP8 twin, with the MTP layer the official checkpoint carries (a V3.2 layer, indexer included).
PRESETS |= {
    "tiny-deepseek-v32-fp8": (PRESETS["tiny-deepseek-v32"][0], dict(
        PRESETS["tiny-deepseek-v32"][1], num_nextn_predict_layers=1, quantization_config=_FP8)),
}
# DeepSeek-V4: one layer of each attention kind (sliding, CSA, HCA), a window of 16 and compression
# rates 4 and 16, so a chat prompt crosses many window and block boundaries; DeepSeek-V4's MTP layer
# declared (num_nextn_predict_layers), as its checkpoints do.
PRESETS |= {
    "tiny-deepseek-v4": ("DeepseekV4ForCausalLM", dict(
        hidden_size=128, moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, partial_rotary_factor=0.25, q_lora_rank=64, o_groups=2,
        o_lora_rank=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
        routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", swiglu_limit=10.0, sliding_window=16,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"], index_n_heads=8, index_head_dim=32, index_topk=8,
        hc_mult=4, hc_sinkhorn_iters=20, rope_theta=10000.0, compress_rope_theta=160000.0,
        num_nextn_predict_layers=1, attention_bias=False)),
}
# Its quantized twin in the format DeepSeek-V4 ships: routed experts FP4 (e2m1, ue8m0 scales per 32
# columns), attention, indexer and shared-expert linears block-FP8 (layers/quant/fp4.py).
PRESETS |= {
    "tiny-deepseek-v4-fp4": (PRESETS["tiny-deepseek-v4"][0], dict(
        PRESETS["tiny-deepseek-v4"][1], quantization_config=dict(_FP8, expert_dtype="fp4"))),
}
# Draft architectures transformers has no config class of their own for.
CONFIG_CLASSES = {"LlamaForCausalLMEagle": "LlamaConfig"}


def train_tokenizer(corpus: str):
    """Byte-level BPE (GPT-2 style pre-tokenization) with the special tokens at ids 0..4."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB, min_frequency=1, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    return tok


def wrap_tokenizer(tok):
    """The transformers tokenizer: no automatic BOS (the chat template decides the framing)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def padded_vocab(tokenizer) -> int:
    return -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def preset_config(name: str, tokenizer):
    """The transformers config object for preset ``name``, ids matching ``tokenizer``."""
    import torch
    import transformers

    arch, sizes = PRESETS[name]
    config_cls = getattr(transformers, CONFIG_CLASSES.get(arch, arch.replace("ForCausalLM", "Config")))
    return config_cls(
        architectures=[arch], vocab_size=padded_vocab(tokenizer),
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, hidden_act="silu",
        tie_word_embeddings=False, initializer_range=0.02, dtype=torch.float32,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **sizes)


def write_presets(out_dir: Path) -> None:
    import transformers

    tokenizer = wrap_tokenizer(train_tokenizer(CORPUS.read_text(encoding="utf-8")))
    for name in PRESETS:
        d = out_dir / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        preset_config(name, tokenizer).save_pretrained(d)
        # Chat turns end with <|im_end|>: generation stops on it as on <|eos|>, the way
        # chat checkpoints list several ids in generation_config.json.
        eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
        transformers.GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                                      pad_token_id=tokenizer.pad_token_id).save_pretrained(d)
        # Template inside tokenizer_config.json, so copying that one file carries it.
        tokenizer.save_pretrained(d, save_jinja_files=False)
        print(f"{d}: vocab {len(tokenizer)} (config {padded_vocab(tokenizer)})")


def check_presets(out_dir: Path) -> None:
    """Reload every preset offline and build its (random-weight) model once."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    for name in PRESETS:
        d = out_dir / name
        tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
        cfg = AutoConfig.from_pretrained(d, local_files_only=True)
        text = "Hello, world! The lighthouse keeper counted 112 steps."
        assert tok.decode(tok.encode(text)) == text
        tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        model = AutoModelForCausalLM.from_config(cfg)
        n = sum(p.numel() for p in model.parameters())
        print(f"{name}: {type(model).__name__}, {n / 1e6:.2f}M params")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PRESETS_DIR)
    parser.add_argument("--check", action="store_true", help="reload and build each preset")
    args = parser.parse_args(argv)
    write_presets(args.out)
    if args.check:
        check_presets(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
