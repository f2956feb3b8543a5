"""What constrained decoding costs: output tokens/s of json_schema requests against the same
requests unconstrained, at batch 1 and 32, side by side in one run on one offline Engine; and
the compile time of a large JSON schema, cold and cached (docs/structured-outputs.md).

    python benchmark/bench_constrained.py --model tiny-llama --batch-sizes 1 32 --output-len 64

Every request generates exactly ``--output-len`` tokens: unconstrained ones ignore EOS, and the
schema (an object whose list needs more items than fit) never completes first, so both sides
decode the same number of steps. Rounds alternate unconstrained, constrained (the device's
default: on CPU masks are filled after the forward), constrained with the masks filled on the
mask thread during the forward (the GPU default), so load from other
processes hits all alike; each side's tokens/s is the median over ``--repeats`` rounds, the
cost is 1 - the median per-round ratio (constrained / unconstrained), and the process's CPU
time per token (all threads) is printed beside it: on a shared machine it moves less than wall
time. The grammar is
compiled (and cached) before the first timed round: the decode cost is measured, compile apart.
Each constrained output is checked to be a valid prefix of the schema's language.

Jump-forward (``--grammar-jump-forward``): a record schema whose keys and punctuation are forced
(``record_schema``: enums, booleans, bounded integers under long keys), generated to completion
with jump-forward off and on, alternating rounds on the same engine: output tokens/s (each side's
own tokens: jump-forward tokenizes the forced text itself, so the counts differ), documents/s (the
fair comparison: the same schema, completed) and tokens per document, medians over ``--repeats``.

Compile: a schema of ``--schema-fields`` properties (strings with patterns, bounded integers,
enums, nested objects and arrays) compiled by a fresh compile service with the backend already
built (cold: ``--compile-repeats`` distinct variants, median), then the same again (cached).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from pdserve.config import GrammarConfig


def long_schema(items: int) -> str:
    """An object holding a list that needs ``items`` entries: never complete within the run."""
    return json.dumps({"type": "object", "properties": {"rows": {
        "type": "array", "minItems": items, "items": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tag": {"enum": ["alpha", "beta", "gamma"]}}, "required": ["id", "tag"]}}},
        "required": ["rows"]})


def record_schema() -> str:
    """A record that completes, mostly forced text: long keys, enums, booleans, bounded integers."""
    props = {
        "customer_account_status": {"enum": ["active", "suspended", "closed"]},
        "preferred_contact_channel": {"enum": ["email", "telephone", "postal_mail"]},
        "marketing_consent_given": {"type": "boolean"},
        "loyalty_programme_tier": {"enum": ["bronze", "silver", "gold", "platinum"]},
        "outstanding_invoice_count": {"type": "integer", "minimum": 0, "maximum": 9},
        "requires_manual_review": {"type": "boolean"},
    }
    return json.dumps({"type": "object", "properties": props, "required": list(props),
                       "additionalProperties": False})


def jump_forward_cost(engine, batch: int, args) -> dict:
    """Documents of ``record_schema`` with jump-forward off and on (module docstring)."""
    prompts = make_prompts(batch, args.prompt_len, seed=100 + batch)
    params = {"max_new_tokens": 512, "temperature": 0, "json_schema": record_schema()}
    grammars = engine.scheduler.grammar
    config = grammars.config
    sides = {side: dataclasses.replace(config, jump_forward=side == "on") for side in ("off", "on")}
    tok_s: dict[str, list[float]] = {"off": [], "on": []}
    doc_s: dict[str, list[float]] = {"off": [], "on": []}
    tokens: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for c in sides.values():  # warm-up (and compile once)
            grammars.config = c
            timed(engine, prompts, params)
        for _ in range(args.repeats):
            for side, c in sides.items():
                grammars.config = c
                dt, _, out = timed(engine, prompts, params)
                for o in out:
                    assert o["meta_info"]["finish_reason"]["type"] == "stop", o
                    json.loads(o["text"])
                n = sum(len(o["output_ids"]) for o in out)
                tok_s[side].append(n / dt)
                doc_s[side].append(batch / dt)
                tokens[side].append(n / batch)
    finally:
        grammars.config = config
    return {"batch": batch, **{f"{k}_{side}": statistics.median(v[side]) for k, v in
                               (("tok_s", tok_s), ("doc_s", doc_s), ("tokens_per_doc", tokens)) for side in sides}}


def large_schema(fields: int, variant: int = 0) -> str:
    """``fields`` properties of mixed kinds (``variant`` renames them, so each variant compiles anew)."""
    kinds = [
        {"type": "string", "pattern": "^[a-z]{1,12}$"},
        {"type": "integer", "minimum": 0, "maximum": 10_000},
        {"enum": ["red", "green", "blue", "cyan"]},
        {"type": "array", "items": {"type": "number"}, "maxItems": 8},
        {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"type": "string", "format": "date"}},
         "required": ["x"]},
    ]
    props = {f"f{variant}_{i}": kinds[i % len(kinds)] for i in range(fields)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)[: fields // 2]})


def make_prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1500, (batch, prompt_len), generator=g).tolist()


def timed(engine, prompts, params: dict) -> tuple[float, float, list[dict]]:
    """(wall seconds, this process's CPU seconds over all its threads, outputs)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = engine.generate(input_ids=prompts, sampling_params=params)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = out if isinstance(out, list) else [out]
    return dt, cpu, out


def decode_cost(engine, batch: int, args, schema: str) -> dict:
    prompts = make_prompts(batch, args.prompt_len, seed=batch)
    plain = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    constrained = {"max_new_tokens": args.output_len, "temperature": 0, "json_schema": schema}
    timed(engine, prompts, plain)  # warm-up both (and compile the grammar once)
    timed(engine, prompts, constrained)
    mask_s, mask_steps = 0.0, 0  # the mask figures of the default-mode rounds
    rates: dict[str, list[float]] = {"plain": [], "constrained": [], "thread": []}
    cpu_ms: dict[str, list[float]] = {"plain": [], "constrained": [], "thread": []}  # CPU ms per token
    grammars = engine.scheduler.grammar
    default = grammars.overlap
    for _ in range(args.repeats):
        for side, params in (("plain", plain), ("constrained", constrained), ("thread", constrained)):
            # constrained: the device's default (CPU: masks filled after the forward); thread: on the
            # mask thread during the forward
            grammars.overlap = default if side != "thread" else True
            before = grammars.stats.to_dict()["mask_seconds"]
            dt, cpu, out = timed(engine, prompts, params)
            if side == "constrained":
                after = grammars.stats.to_dict()["mask_seconds"]
                mask_s += after["sum"] - before["sum"]
                mask_steps += after["count"] - before["count"]
            assert all(len(o["output_ids"]) == args.output_len for o in out), side
            if side != "plain":
                assert all(o["text"].startswith('{"rows": [') or o["text"].startswith('{"rows":[') for o in out)
            rates[side].append(batch * args.output_len / dt)
            cpu_ms[side].append(1e3 * cpu / (batch * args.output_len))
    grammars.overlap = default
    ratios = [c / p for c, p in zip(rates["constrained"], rates["plain"])]
    thread = [c / p for c, p in zip(rates["thread"], rates["plain"])]
    return {"batch": batch, "plain_tok_s": statistics.median(rates["plain"]),
            "constrained_tok_s": statistics.median(rates["constrained"]),
            "ratio": statistics.median(ratios), "cost_pct": 100 * (1 - statistics.median(ratios)),
            "thread_tok_s": statistics.median(rates["thread"]),
            "thread_cost_pct": 100 * (1 - statistics.median(thread)),
            "cpu_ms_per_token": {k: statistics.median(v) for k, v in cpu_ms.items()},
            "mask_ms_per_step": 1e3 * mask_s / mask_steps if mask_steps else 0.0,
            "tokens_per_step": batch}


def compile_times(tokenizer, vocab: int, backend: str, args) -> dict:
    from pdserve.constrained import create_grammar_backend
    from pdserve.constrained.service import CompileService

    config = GrammarConfig(backend, cache_size=4 * args.compile_repeats)
    built = create_grammar_backend(config, tokenizer, vocab, [tokenizer.eos_token_id])
    service = CompileService(lambda: built, config)
    try:
        service.backend()
        schemas = [large_schema(args.schema_fields, v) for v in range(args.compile_repeats)]
        cold, cached = [], []
        for s in schemas:
            t0 = time.perf_counter()
            service.compile("json_schema", s)
            cold.append(time.perf_counter() - t0)
        for s in schemas:
            t0 = time.perf_counter()
            service.compile("json_schema", s)
            cached.append(time.perf_counter() - t0)
    finally:
        service.close()
    return {"backend": backend, "schema_chars": len(schemas[0]), "fields": args.schema_fields,
            "cold_ms": 1e3 * statistics.median(cold), "cached_ms": 1e3 * statistics.median(cached)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--grammar-backend", default="xgrammar")
    ap.add_argument("--compile-backends", nargs="*", default=["xgrammar", "llguidance", "outlines"])
    ap.add_argument("--schema-fields", type=int, default=200)
    ap.add_argument("--compile-repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = ap.parse_args(argv)

    import pdserve

    kw = {"num_threads": args.num_threads} if args.num_threads else {}
    engine = pdserve.Engine(model_path=args.model, grammar_backend=args.grammar_backend,
                            constrained_json_disable_any_whitespace=True,
                            max_running_requests=max(args.batch_sizes), **kw)
    try:
        schema = long_schema(items=10 * args.output_len)
        decode = [decode_cost(engine, b, args, schema) for b in args.batch_sizes]
        jumps = [jump_forward_cost(engine, b, args) for b in args.batch_sizes]
        compiles = [compile_times(engine.tokenizer, engine.scheduler.model_config.vocab_size, b, args)
                    for b in args.compile_backends]
    finally:
        engine.shutdown()
    if args.json:
        print(json.dumps({"decode": decode, "jump_forward": jumps, "compile": compiles}))
        return
    print(f"decode ({args.model}, {args.grammar_backend}, {args.output_len} tokens per request, "
          f"median of {args.repeats} alternating rounds)")
    print(f"{'batch':>5} {'plain tok/s':>12} {'json_schema tok/s':>18} {'ratio':>6} {'cost':>7} {'mask ms/step':>13} "
          f"{'mask-thread tok/s':>18} {'its cost':>9}   CPU ms/token: plain / json_schema / mask-thread")
    for d in decode:
        c = d["cpu_ms_per_token"]
        print(f"{d['batch']:>5} {d['plain_tok_s']:>12.1f} {d['constrained_tok_s']:>18.1f} {d['ratio']:>6.3f} "
              f"{d['cost_pct']:>6.1f}% {d['mask_ms_per_step']:>13.3f} {d['thread_tok_s']:>18.1f} "
              f"{d['thread_cost_pct']:>8.1f}%   {c['plain']:.3f} / {c['constrained']:.3f} / {c['thread']:.3f}")
    print(f"\njump-forward on a record schema (median of {args.repeats} alternating rounds)")
    print(f"{'batch':>5} {'tok/s off':>10} {'tok/s on':>10} {'docs/s off':>11} {'docs/s on':>10} {'speedup':>8} "
          f"{'tokens/doc off':>15} {'on':>5}")
    for j in jumps:
        print(f"{j['batch']:>5} {j['tok_s_off']:>10.1f} {j['tok_s_on']:>10.1f} {j['doc_s_off']:>11.2f} "
              f"{j['doc_s_on']:>10.2f} {j['doc_s_on'] / j['doc_s_off']:>7.2f}x {j['tokens_per_doc_off']:>15.1f} "
              f"{j['tokens_per_doc_on']:>5.1f}")
    print(f"\ncompile of a {args.schema_fields}-field schema (median of {args.compile_repeats})")
    print(f"{'backend':>10} {'chars':>7} {'cold ms':>9} {'cached ms':>10}")
    for c in compiles:
        print(f"{c['backend']:>10} {c['schema_chars']:>7} {c['cold_ms']:>9.2f} {c['cached_ms']:>10.4f}")


if __name__ == "__main__":
    main()
