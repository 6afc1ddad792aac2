"""Shared helpers of the rollout tests: tiny random Qwen3-MoE / Mixtral checkpoints saved as real HF folders,
transformers references (greedy generate, log-probs and the router's picks through forward hooks), and a
step-by-step replay of slot admission (the reference of the planner's schedules)."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np
import torch

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"


def tiny_hf_config(arch: str, **overrides):
    from transformers import MixtralConfig, Qwen3MoeConfig

    if arch == "qwen3_moe":
        kw = dict(
            vocab_size=96,
            hidden_size=48,
            intermediate_size=64,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            max_position_embeddings=512,
            rope_theta=10000.0,
            initializer_range=0.1,
            eos_token_id=None,
            pad_token_id=0,
        )
        kw.update(overrides)
        return Qwen3MoeConfig(**kw)
    kw = dict(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        initializer_range=0.1,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    kw.update(overrides)
    return MixtralConfig(**kw)


def save_tiny_model(arch: str, path: Path, seed: int = 0, **overrides):
    """Build a tiny random HF model in fp32 and save it with save_pretrained; returns the model (eval mode)."""
    from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cls = Qwen3MoeForCausalLM if arch == "qwen3_moe" else MixtralForCausalLM
    model = cls(tiny_hf_config(arch, **overrides)).float().eval()
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_logprobs_and_routes(
    model, tokens: list[int], num_prompt: int, temperature: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """log softmax(logits / temperature) of each generated token given the ones before it, and the router's
    top-k ids [T, L, K] of every token, from one full forward with hooks on the router modules."""
    picks = []

    def hook(_module, _inputs, output):
        picks.append(output[2].detach().cpu())

    routers = [
        m for name, m in model.named_modules() if name.endswith("mlp.gate") or name.endswith("moe.gate")
    ]
    handles = [m.register_forward_hook(hook) for m in routers]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens], device=model.device)).logits[0].float().cpu()
    finally:
        for h in handles:
            h.remove()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    gen = torch.tensor(tokens[num_prompt:])
    lp = logprobs[num_prompt - 1 : len(tokens) - 1].gather(1, gen[:, None]).squeeze(1)
    return lp.numpy(), torch.stack(picks, dim=1).numpy()


def interpreter_results(*argv: str, timeout: float = 300) -> dict:
    """Run `python *argv` with TRITON_INTERPRET=1 (it must be set before triton is imported, hence a subprocess)
    and return the JSON of its last stdout line. Skips without Triton, and on CUDA machines, where the compiled
    kernels are tested instead (the GPU machine's Triton build also fails inside its own interpreter: a numpy
    scalar conversion in interpreter.py, which says nothing about the kernels)."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest
    import torch

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not importable: the kernels cannot run, not even in its interpreter")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the compiled-kernel tests cover the kernels")
    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def replay(context_N, new_N, slots: int) -> tuple[list[int], list[int], list[int]]:
    """Step by step: at every step free slots admit the next requests in order (each prefilled that step, its
    first token from the prefill), then every admitted request that still has tokens to generate decodes one.
    Returns the start step of each request and, per step from 1 on, the decoding rows and their cached keys."""
    pending, start, made = deque(range(len(new_N))), {}, {}
    rows, keys = [], []
    t = 0
    while pending or any(made[i] < new_N[i] for i in made):
        holding = [i for i in start if made[i] < new_N[i]]
        while pending and len(holding) < slots:
            i = pending.popleft()
            start[i], made[i] = t, 1
            holding.append(i)
        if t:
            live = [i for i in holding if start[i] < t]
            rows.append(len(live))
            keys.append(sum(context_N[i] + made[i] for i in live))
            for i in live:
                made[i] += 1
        t += 1
    return [start[i] for i in range(len(new_N))], rows, keys
