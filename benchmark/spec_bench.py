"""Speculative decoding, measured honestly: random drafts accept nothing, so this first trains
tiny-deepseek's MTP layer (NEXTN) on the target's own greedy outputs (CPU, fixed seed, a few
minutes), then measures decode tokens/s and ITL with and without speculation, colocated and
1P1D, side by side in one run. Not in CI.

    python benchmark/spec_bench.py --train-seconds 180 --out /tmp/mtp

Training: sequences = random prompt + the target's greedy continuation; the target's final-normed
hidden states of each sequence are computed once (the engine's own model runner); the MTP layer
(eh_proj, the decoder layer but MLA's kv_b_proj, shared_head) learns to predict token p + 2 from
(token p + 1, target hidden p), attention written contiguously (layers/attention/reference.py) so
gradients flow. The trained layer is saved as ``model.layers.{N}.*`` and served with
``--speculative-draft-model-path``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-deepseek"


class ContiguousMLA:
    """Training-time attention backend: one sequence per forward, MLA as the paper states it."""

    def forward_mla(self, q_nope, q_pe, latent, k_pe, w_kc, w_vc, layer_id, scale, fb):
        from pdserve.layers.attention.reference import mla_reference

        return mla_reference(q_nope, q_pe, latent, k_pe, w_kc, w_vc, scale)


def make_data(num_seqs: int, prompt_len: int, new_tokens: int, seed: int) -> list[list[int]]:
    import pdserve

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 1900, (prompt_len,), generator=g).tolist() for _ in range(num_seqs)]
    eng = pdserve.Engine(model_path=MODEL, page_size=1)
    outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": new_tokens, "temperature": 0.0,
                                                            "ignore_eos": True})
    return [p + o["output_ids"] for p, o in zip(prompts, outs)]


def target_hidden(runner, seq: list[int]) -> torch.Tensor:
    """[L, H] the target's final-normed hidden states of every position of ``seq``."""
    from pdserve.engine.model_runner import ScheduledBatch
    from pdserve.layers.forward_batch import ForwardMode

    L = len(seq)
    batch = ScheduledBatch(ForwardMode.EXTEND, seq, list(range(L)), list(range(L)), [0], [L], [0])
    _, hidden = runner.forward_all_rows(batch, torch.arange(L)[None, :])
    return hidden.clone()


def train(seconds: float, seed: int, out: Path, num_seqs: int, prompt_len: int, new_tokens: int) -> dict:
    from pdserve.config import CacheConfig, ModelConfig
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.layers.forward_batch import ForwardBatch, ForwardMode
    from pdserve.models.base import checkpoint_tensors
    from pdserve.models.draft import DeepseekMTP
    from pdserve.models.loader import init_dummy_weights

    torch.manual_seed(seed)
    seqs = make_data(num_seqs, prompt_len, new_tokens, seed)
    mc = ModelConfig.from_path(MODEL, load_format="dummy")
    runner = ModelRunner(mc, CacheConfig(page_size=1, max_total_tokens=4096), seed=0)
    hiddens = [target_hidden(runner, s) for s in seqs]
    mtp = DeepseekMTP(runner.model, torch.float32)
    init_dummy_weights(mtp, seed + 1)
    mtp.embed_tokens = runner.model.model.embed_tokens  # shared, frozen
    mtp.process_weights_after_loading()
    frozen = {id(p) for p in mtp.embed_tokens.parameters()} | {id(mtp.self_attn.kv_b_proj.weight)}
    params = [p for p in mtp.parameters() if id(p) not in frozen]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=1e-3)
    backend = ContiguousMLA()
    split = int(0.9 * len(seqs))
    train_set, held_out = list(range(split)), list(range(split, len(seqs)))

    def batch_loss(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq, hid = seqs[i], hiddens[i]
        L = len(seq) - 2  # rows p = 0 .. L-1 predict seq[p + 2]
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        fb = ForwardBatch(ForwardMode.EXTEND, t(seq[1:L + 1]), torch.arange(L), torch.arange(L), t([0]), t([L]),
                          t([L]), torch.arange(L)[None], runner.pool, backend)
        logits = mtp.compute_logits(mtp(fb, hid[:L]))  # [L, V]
        rows = torch.arange(max(0, prompt_len - 2), L)  # targets that are the target's own outputs
        labels = t(seq[2:L + 2])[rows]
        return torch.nn.functional.cross_entropy(logits[rows], labels), (logits[rows].argmax(-1) == labels).float()

    start, step = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        opt.zero_grad()
        idx = torch.randint(len(train_set), (4,)).tolist()
        loss = sum(batch_loss(train_set[i])[0] for i in idx) / len(idx)
        loss.backward()
        opt.step()
        step += 1
        if step % 50 == 0:
            print(f"step {step:5d}  loss {float(loss):.3f}  {time.monotonic() - start:.0f}s", flush=True)
    with torch.no_grad():
        acc = torch.cat([batch_loss(i)[1] for i in held_out]).mean().item()
    print(f"trained {step} steps; held-out next-next-token accuracy {acc:.1%}")
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    n = mc.num_layers
    tensors = {f"model.layers.{n}.{k}": v.detach().contiguous() for k, v in checkpoint_tensors(mtp)
               if not k.startswith("embed_tokens")}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text((Path(mc.path) / "config.json").read_text())  # a NextN checkpoint's own
    return {"steps": step, "held_out_accuracy": acc}


def _decode_run(engine_kwargs: dict, prompts: list[list[int]], new: int) -> dict:
    import pdserve

    eng = pdserve.Engine(model_path=MODEL, page_size=4, **engine_kwargs)
    sp = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    eng.generate(input_ids=prompts[:1], sampling_params={**sp, "max_new_tokens": 4})  # warm-up
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=sp)
    dt = time.perf_counter() - t0
    toks = sum(len(o["output_ids"]) for o in outs)
    m = outs[0]["meta_info"]
    return {"tokens_per_s": toks / dt, "itl_ms": 1e3 * dt / max(1, new), "outputs": [o["output_ids"] for o in outs],
            "accept_length": m.get("spec_accept_length"), "accept_rate": m.get("spec_accept_rate")}


def _pd_run(flags: dict, prompts: list[list[int]], new: int) -> dict:
    sys.path.insert(0, str(ROOT / "test" / "disagg"))
    sys.path.insert(0, str(ROOT / "test"))
    from pd_pair import PDPair, greedy

    pair = PDPair(MODEL, backend="memory", page_size=4, **flags)
    try:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            pair.submit(f"r{i}", p, greedy(new))
        pair.run()
        dt = time.perf_counter() - t0
        outs = [pair.outputs[f"r{i}"] for i in range(len(prompts))]
        st = pair.decode.stats()
        return {"tokens_per_s": sum(len(o["ids"]) for o in outs) / dt, "itl_ms": 1e3 * dt / max(1, new),
                "outputs": [o["ids"] for o in outs],
                "accept_length": st.get("spec_accept_length"), "accept_rate": None}
    finally:
        pair.close()


def measure(draft: Path, steps: int, batch: int, new: int, seed: int, training_prompts: int = 0) -> None:
    """``training_prompts``: the prompt length of the training run when measuring on its first
    prompts (a check that the trained layer is the one served; 0: new prompts)."""
    g = torch.Generator().manual_seed(seed if training_prompts else seed + 100)
    prompts = [torch.randint(5, 1900, (training_prompts or 16,), generator=g).tolist() for _ in range(batch)]
    spec = {"speculative_algorithm": "NEXTN", "speculative_num_steps": steps,
            "speculative_draft_model_path": str(draft)}
    rows = {"colocated": _decode_run({}, prompts, new), "colocated + NEXTN": _decode_run(spec, prompts, new),
            "1P1D": _pd_run({}, prompts, new), "1P1D + NEXTN": _pd_run(spec, prompts, new)}
    base = {"colocated": rows["colocated"], "1P1D": rows["1P1D"]}
    print(f"\nbatch {batch}, {new} new tokens each, NEXTN steps {steps}, {os.environ.get('OMP_NUM_THREADS', '?')}"
          f" threads")
    print(f"{'run':20s} {'tok/s':>8s} {'ITL ms':>8s} {'speed-up':>9s} {'accept len':>11s} {'same tokens':>12s}")
    for name, r in rows.items():
        ref = base[name.split(" + ")[0]]
        same = r["outputs"] == ref["outputs"]
        acc = f"{r['accept_length']:.2f}" if r["accept_length"] else "-"
        print(f"{name:20s} {r['tokens_per_s']:8.1f} {r['itl_ms']:8.2f} {r['tokens_per_s'] / ref['tokens_per_s']:8.2f}x"
              f" {acc:>11s} {str(same):>12s}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-seconds", type=float, default=180)
    p.add_argument("--out", type=Path, default=Path("/tmp/pdserve-mtp"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-seqs", type=int, default=96)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="--speculative-num-steps")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--measure-tokens", type=int, default=64)
    p.add_argument("--skip-train", action="store_true", help="measure with the layer already in --out")
    p.add_argument("--on-training-prompts", action="store_true",
                   help="measure on the training run's first prompts (checks the served layer is the trained one)")
    ns = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not ns.skip_train:
        train(ns.train_seconds, ns.seed, ns.out, ns.num_seqs, ns.prompt_len, ns.new_tokens)
    measure(ns.out, ns.steps, ns.batch, ns.measure_tokens, ns.seed, ns.prompt_len if ns.on_training_prompts else 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
