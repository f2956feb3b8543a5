"""The benchmark suite: ``pdserve bench`` (a streaming serving client whose numbers match
``sglang.bench_serving`` and ``vllm bench serve``) and ``pdserve plan`` (a P:D ratio planner).

Nothing here imports torch or any server code: the client runs against any
SGLang-native or OpenAI-compatible server.
"""
