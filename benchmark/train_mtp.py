"""Train a tiny DeepSeek-V3 preset's MTP (next-n) head on the target's own greedy outputs, so
speculative decoding can be measured at a realistic acceptance rate (random weights accept
nothing). CPU only, a few minutes, fixed seed; not part of CI.

    python benchmark/train_mtp.py --out /tmp/tiny-deepseek-mtp --minutes 4

Writes a Hugging Face checkpoint directory: the preset's seeded dummy weights (exactly what
``--load-format dummy`` serves, so plain decoding of the checkpoint is the preset's output) plus
one trained MTP layer ``model.layers.{num_hidden_layers}.*`` in DeepSeek-V3's layout (``enorm``,
``hnorm``, ``eh_proj``, a full MoE decoder layer, ``shared_head.{norm,head}``,
``embed_tokens``), ``num_nextn_predict_layers`` 1 in config.json, and the preset's tokenizer.

How the head is trained (legend: B sequences, S positions, H hidden, V vocab):
1. the target (pdserve's offline Engine on the checkpoint without the MTP layer) continues
   random prompts greedily: that is the text speculation will have to predict;
2. transformers runs the target over each whole sequence once and keeps its final normed hidden
   states h[B, S, H] (what pdserve hands the draft: ``CausalLM.forward``'s output);
3. the MTP module reads (embedding of token i+1, h_i) and is trained with cross-entropy to
   predict token i+2: exactly the step the draft takes at decode time. Embeddings and the
   target stay frozen; the shared head starts from the target's ``lm_head``.
Held-out top-1 accuracy of that prediction (the first draft token's acceptance under greedy
verification) is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

PRESET = "tiny-deepseek"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_target(out: Path, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """The preset's dummy weights as a safetensors checkpoint in ``out`` (no MTP layer yet)."""
    from safetensors.torch import save_file

    from pdserve.config import ModelConfig, resolve_model_path
    from pdserve.models.loader import dummy_checkpoint

    preset_dir, _ = resolve_model_path(PRESET)
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads((preset_dir / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 0
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    for name in TOKENIZER_FILES:
        if (preset_dir / name).is_file():
            shutil.copy(preset_dir / name, out / name)
    mc = ModelConfig.from_path(PRESET, load_format="dummy")
    tensors = {k: v.contiguous().clone() for k, v in dummy_checkpoint(mc, seed)}
    save_file(tensors, str(out / "model.safetensors"))
    return raw, tensors


def greedy_sequences(model_dir: Path, num: int, prompt_len: int, output_len: int, seed: int,
                     vocab: int) -> torch.Tensor:
    """[num, prompt_len + output_len] token ids: random prompts continued greedily by pdserve."""
    from pdserve.entrypoints.engine import Engine

    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(5, vocab, (num, prompt_len), generator=gen).tolist()
    params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
    with Engine(str(model_dir), load_format="safetensors", random_seed=seed) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    rows = [p + o["output_ids"] for p, o in zip(prompts, outs)]
    return torch.tensor(rows, dtype=torch.int64)


class MTPHead(nn.Module):
    """DeepSeek-V3's next-n module in transformers' layers, trainable: (token i+1, h_i) -> logits of i+2."""

    def __init__(self, cfg, layer_idx: int, embed: nn.Embedding, lm_head: nn.Linear):
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

        super().__init__()
        h = cfg.hidden_size
        self.embed = embed  # frozen, shared with the target
        self.enorm = ds.DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hnorm = ds.DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = ds.DeepseekV3DecoderLayer(cfg, layer_idx)
        self.head_norm = ds.DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.head.weight.data.copy_(lm_head.weight.data)
        self.rotary = ds.DeepseekV3RotaryEmbedding(cfg)

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # next_ids [B, S] tokens i+1; hidden [B, S, H] target hidden of i -> logits [B, S, V] of i+2
        x = self.eh_proj(torch.cat([self.enorm(self.embed(next_ids)), self.hnorm(hidden)], dim=-1))
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]  # causal
        x = self.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x, pos))
        return self.head(self.head_norm(x))

    def checkpoint(self, prefix: str) -> dict[str, torch.Tensor]:
        """The module's tensors under DeepSeek-V3's MTP names (``prefix`` = model.layers.N)."""
        out = {f"{prefix}.{n}.weight": getattr(self, n).weight for n in ("enorm", "hnorm", "eh_proj")}
        out[f"{prefix}.shared_head.norm.weight"] = self.head_norm.weight
        out[f"{prefix}.shared_head.head.weight"] = self.head.weight
        out[f"{prefix}.embed_tokens.weight"] = self.embed.weight
        for k, v in self.layer.state_dict().items():
            out.update(per_expert(f"{prefix}.{k}", v))
        return {k: v.detach().contiguous().clone() for k, v in out.items()}


def per_expert(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers 5 holds experts fused (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]);
    DeepSeek's checkpoints name each expert's matrices: split back into that layout."""
    base, _, name = key.rpartition(".")
    if not base.endswith("mlp.experts") or name not in ("gate_up_proj", "down_proj"):
        return {key: tensor}
    if name == "down_proj":
        return {f"{base}.{e}.down_proj.weight": w for e, w in enumerate(tensor)}
    inter = tensor.shape[1] // 2
    out = {f"{base}.{e}.gate_proj.weight": w[:inter] for e, w in enumerate(tensor)}
    out.update({f"{base}.{e}.up_proj.weight": w[inter:] for e, w in enumerate(tensor)})
    return out


def target_hidden(model_dir: Path, seqs: torch.Tensor) -> tuple[torch.Tensor, nn.Module]:
    """transformers' target on the checkpoint: final normed hidden states [B, S, H] of ``seqs``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = torch.cat([model.model(input_ids=seqs[i:i + 16]).last_hidden_state
                            for i in range(0, len(seqs), 16)])
    return hidden, model


def accuracy(head: MTPHead, ids: torch.Tensor, hidden: torch.Tensor, start: int) -> float:
    """Top-1 of the i+2 prediction over the generated part (from ``start``), no grad."""
    with torch.no_grad():
        logits = head(ids[:, 1:-1], hidden[:, :-2])  # [B, S-2, V]
        pred = logits.argmax(-1)[:, start:]
        return float((pred == ids[:, 2 + start:]).float().mean())


def train(head: MTPHead, ids: torch.Tensor, hidden: torch.Tensor, minutes: float, batch: int,
          lr: float, seed: int) -> int:
    """Adam over random mini-batches until the time budget is spent; returns the steps taken."""
    params = [p for n, p in head.named_parameters() if not n.startswith("embed.")]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    deadline = time.monotonic() + minutes * 60
    steps = 0
    while time.monotonic() < deadline:
        pick = torch.randint(0, len(ids), (batch,), generator=gen)
        x, h = ids[pick], hidden[pick]
        logits = head(x[:, 1:-1], h[:, :-2])  # predict token i+2
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 2:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        if steps % 50 == 0:
            print(f"step {steps}: loss {loss.item():.3f}", flush=True)
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--num-seqs", type=int, default=384)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=112)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    raw, weights = write_target(out, args.seed)

    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(out))
    with tempfile.TemporaryDirectory():
        seqs = greedy_sequences(out, args.num_seqs, args.prompt_len, args.output_len, args.seed, cfg.vocab_size)
    hidden, target = target_hidden(out, seqs)
    n_layers = cfg.num_hidden_layers
    mtp_cfg = AutoConfig.from_pretrained(str(out))
    mtp_cfg.num_hidden_layers = n_layers + 1  # the MTP layer's index must count as a MoE layer
    mtp_cfg._attn_implementation = "sdpa"  # standalone layers are not dispatched by a parent model
    mtp_cfg._experts_implementation = "eager"
    head = MTPHead(mtp_cfg, n_layers, target.model.embed_tokens, target.lm_head)
    held = max(1, len(seqs) // 8)
    before = accuracy(head, seqs[:held], hidden[:held], args.prompt_len)
    steps = train(head, seqs[held:], hidden[held:], args.minutes, args.batch, args.lr, args.seed)
    after = accuracy(head, seqs[:held], hidden[:held], args.prompt_len)

    from safetensors.torch import save_file

    weights.update(head.checkpoint(f"model.layers.{n_layers}"))
    save_file(weights, str(out / "model.safetensors"))
    raw["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    print(json.dumps({"out": str(out), "steps": steps, "minutes": args.minutes,
                      "heldout_top1_before": round(before, 3), "heldout_top1_after": round(after, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
