"""Megatron-Core training engine for MoE policies and critics (Qwen3-MoE, Mixtral), on GPU and CPU.

Modules (import them directly; this package imports nothing heavy):
    config   - ModelConfig, ParallelConfig, OptimConfig: the engine's own configuration
    compat   - the CPU compatibility layer for megatron-core 0.16.1 (active only without CUDA)
    parallel - torch.distributed + Megatron parallel state for TP/PP/EP/DP; explicit group records
    model    - ModelConfig -> Megatron GPTModel (layer spec: SDPA attention, RMSNorm, replay router, experts)
    experts  - grouped-GEMM SwiGLU experts (torch._grouped_mm)
    replay   - routing replay on Megatron's RouterReplay (record / replay / replay under recompute)
    batch    - TrainBatch, ForwardOutput, LossOutput, StepResult records
    layout   - RouterLayout: the shapes micro-batches run through the routers (shared with ReLibra's loads)
    logprobs - per-token log-probs and entropy from vocabulary-parallel logits
    engine   - MegatronEngine: forward, train_step, optimizer, offload, checkpoints, HF export
    convert  - HF safetensors <-> Megatron (streamed, EP-aware, logical expert order)
"""
