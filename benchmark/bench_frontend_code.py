"""CPU per token of the HTTP frontend's own code, without HTTP: TokenizerManager routing 32 streams
of 64 tokens, the incremental detokenizer, the cumulative ``/generate`` bodies and their SSE JSON
(docs/benchmarking.md compares it with the whole frontend's cost from ``bench_server.py``).

    python benchmark/bench_frontend_code.py [ROUNDS]

No scheduler runs: the outputs a scheduler would send each step are handed to the manager's
router directly, and what it would send the scheduler is dropped.
"""

from __future__ import annotations

import asyncio
import sys
import time

from pdserve.assets import preset_dir
from pdserve.config import ServerArgs
from pdserve.engine.io_struct import TokenOutput
from pdserve.engine.request import RequestLimits, SamplingParams
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.entrypoints import native_api
from pdserve.entrypoints.parallel_sampling import PromptJob
from pdserve.entrypoints.tokenizer_manager import TokenizerManager
from pdserve.web.streaming import sse

N, OUT = 32, 64  # streams, tokens each


async def one_round() -> None:
    tok = load_tokenizer(preset_dir("tiny-deepseek"))
    tm = TokenizerManager(ServerArgs(model_path="tiny-deepseek"), tok)
    tm.limits = RequestLimits(4096, tok.vocab_size, 32768)
    tm.healthy = True
    tm._try_send = lambda msg: True  # type: ignore[method-assign]  # no scheduler: requests go nowhere
    sp = SamplingParams(max_new_tokens=OUT, temperature=0.0, ignore_eos=True)
    rids = [f"r{i}" for i in range(N)]
    sent = 0

    async def consume(rid):
        nonlocal sent
        item = native_api._Item(PromptJob([1, 2, 3], sp, 1, False, None, 0, rid, None, None), 0)
        acc = native_api._Cumulative(item, None)
        async for c in tm.generate([1, 2, 3], sp, rid=rid, stream=True):
            sent += len(sse(acc.add(c)))

    tasks = [asyncio.create_task(consume(r)) for r in rids]
    await asyncio.sleep(0)
    t0 = time.process_time()
    for step in range(OUT):
        outs = [TokenOutput(r, [100 + (step * 7 + i) % 900], None, step == OUT - 1, None if step < OUT - 1 else
                            {"type": "length", "length": OUT}, 3, step + 1, 0,
                            timeline={"queue": 0.001} if step == 0 else None) for i, r in enumerate(rids)]
        tm._route_outputs(outs)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    cpu = time.process_time() - t0
    print(f"frontend own code: {cpu / (N * OUT) * 1e6:.1f} us per token ({sent / (N * OUT):.0f} bytes/event)")


if __name__ == "__main__":
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
        asyncio.run(one_round())
