"""The model's layer ops (RMSNorm, SwiGLU, RoPE, the experts' grouped GEMM, the decode step's
element-wise ops): each a torch reference and its kernel, chosen by ``impl``
(:mod:`megatron_grpo.ops.kernels`)."""
