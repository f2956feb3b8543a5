"""pdserve's Triton kernels, each beside the plain-torch twin its tests compare it with.

Installed with pdserve as the top-level package ``pdserve_kernels`` (source: ``kernels/``).
Importing a module here imports triton: pdserve does so only when a Triton path is selected
(``--attention-backend triton``). On a CPU host the kernels run under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is first imported): slow, but the same code.

Modules: ``decode_attention`` (paged GQA and MLA decode, split-KV partials + LSE merge),
``extend_attention`` (prefill/extend over paged KV with a prefix), ``rmsnorm`` (fused with the
residual add), ``rotary`` (in place), ``moe`` (token sort/permute + grouped expert GEMM),
``kv_pack`` (HND head-range pack/unpack for transfers between different TP sizes), ``fp8_gemm``
(block-scaled W8A8 FP8 GEMM, per-token-group activation quantizer), ``fp8_moe`` (fused MoE
over FP8 experts) and ``sparse_mla`` (DeepSeek-V3.2's indexer top-k over the paged index keys and
sparse MLA over the picked latent rows); ``*_ref`` modules hold twins that import no triton.
``index_topk_cpu`` is not Triton: the indexer's score + top-k in plain C (``index_topk_cpu.c``),
compiled on first use and called through ctypes, which the torch_native backend runs on CPU.
``fused_cpu`` is plain C too (``fused_cpu.c``): residual add + RMSNorm, rotary and SiLU x mul, which
the norm, rotary and activation layers run on CPU float32.
"""
