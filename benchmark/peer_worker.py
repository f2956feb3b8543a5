"""One offline engine for ``bench_peer.py``, driven over stdin/stdout (one JSON object a line).

    python peer_worker.py --engine pdserve|vllm --model DIR --batch N [--num-threads T] [--enable-torch-compile]
        [--disable-thread-tuning]

Runs in the engine's own interpreter (vLLM's lives in its own venv), so it imports nothing from
this repository. After start-up it prints ``{"ready": ..., "startup_s": ...}``; then for each
``{"prompts": [[ids]], "max_tokens": N}`` it generates greedily (EOS ignored) and prints
``{"outputs": [[ids]], "wall_s": ...}`` (pdserve's also carries ``thread_tuning``, its
``/get_server_info`` entry). An empty line or EOF stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


class PdserveSide:
    def __init__(self, a: argparse.Namespace):
        import pdserve

        self.engine = pdserve.Engine(model_path=a.model, max_running_requests=a.batch, random_seed=0,
                                     num_threads=a.num_threads, enable_torch_compile=a.enable_torch_compile,
                                     disable_thread_tuning=a.disable_thread_tuning)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        sp = {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return [o["output_ids"] for o in self.engine.generate(input_ids=prompts, sampling_params=sp)]

    def info(self) -> dict:
        return {"thread_tuning": self.engine.get_server_info().get("thread_tuning")}

    def close(self) -> None:
        self.engine.shutdown()


class VllmSide:
    def __init__(self, a: argparse.Namespace):
        from vllm import LLM

        # float32, as pdserve runs these checkpoints on CPU: the greedy tokens must agree
        self.llm = LLM(model=a.model, dtype="float32", seed=0, max_num_seqs=a.batch, disable_log_stats=True)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def info(self) -> dict:
        return {}

    def close(self) -> None:
        del self.llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("pdserve", "vllm"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--num-threads", type=int, default=None, help="pdserve: torch threads (default: its own)")
    ap.add_argument("--enable-torch-compile", action="store_true", help="pdserve: compiled decode steps")
    ap.add_argument("--disable-thread-tuning", action="store_true",
                    help="pdserve: the start-up layout's torch threads, not chosen per step")
    a = ap.parse_args()
    # The protocol keeps its own copy of stdout; fd 1 becomes stderr, so nothing an engine or its
    # child processes print can mix into it.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    t0 = time.perf_counter()
    side = PdserveSide(a) if a.engine == "pdserve" else VllmSide(a)
    print(json.dumps({"ready": a.engine, "startup_s": time.perf_counter() - t0}), file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        t0 = time.perf_counter()
        outputs = side.generate(req["prompts"], req["max_tokens"])
        wall = time.perf_counter() - t0
        print(json.dumps({"outputs": outputs, "wall_s": wall, **side.info()}), file=out, flush=True)
    side.close()


if __name__ == "__main__":
    main()
