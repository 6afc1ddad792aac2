"""Triton kernels of the rollout engine beyond attention.

`rollout.kernels.persistent_moe`: the persistent, tile-scheduled MoE expert MLP (ExpertPlex): decode tiles
first, prefill tiles preemptible between tiles, resumable, with an exact torch reference."""


def interpreted(kernel) -> bool:
    """Whether `kernel` (a @triton.jit function) runs in Triton's interpreter: this process imported Triton with
    TRITON_INTERPRET=1. Launch options that work around the interpreter (its bf16 dot is wrong: operands are
    widened) follow this, not the tensors' device, so that a compile-only run on a machine without a GPU
    (tests/rollout/test_kernels_compile.py) builds the options a GPU launch uses."""
    return type(kernel).__name__ == "InterpretedFunction"
