"""The rollout engine's Triton kernels compile for Hopper (sm_90a) on a machine without a GPU: Triton's CUDA backend
lowers each launch the engine and the benches make (persistent MoE: plain, flagged with 1-8 preemption slices,
TMA, fp32; paged attention: decode with and without splits, prefill) down to PTX and through ptxas to a cubin,
with the launch options a GPU launch uses. Nothing runs: a compile-only Triton driver stands in for the GPU
(its target sm_90a, an H100/H200's 227 KB of shared memory per block), so Triton's own checks still apply
(shared memory and threads per block, and the persistent MoE launch's fall back to fewer pipeline stages when
fp32 tiles do not fit). The interpreter tests check what the kernels compute; this checks that the code the
GPU would compile is code Triton and ptxas accept, between the sessions that have a GPU.

Run as a script (what the test does, in a subprocess: the stand-in driver must not meet a real one) it prints one
JSON line: per case, the kernels compiled with their shared memory, stages, registers and stack (spills), or
the compiler's error.

The GPU machine's Triton is older than this one's (torch 2.11's build there): a kernel that compiles here may
still fail there, which the GPU tests (`pytest -m gpu`) catch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SHARED_MEM_PER_BLOCK = 232_448  # bytes a block may opt into on the H100 and H200 (227 KB)
MAX_THREADS_PER_BLOCK = 1024
SMS = 132  # an H100 SXM's (the H200 has as many): the persistent launches' grid is a multiple of it

# Qwen3-30B-A3B's widths (hidden 2048, expert FFN 768, top-8) over 8 experts: the launches specialise on the
# strides, which these widths set as the model does; 128 experts would only make the CPU tensors larger.
MOE = dict(T=96, H=2048, F=768, E=8, K=8, num_decode=32, routing="topk")
# name: (dtype, flagged, preemption slices, tma, decode only: all T tokens in decode tiles, which S = 16 E / K = 16
# tokens make wide, with their own launch options)
MOE_CASES = {
    "moe_bf16": ("bfloat16", False, 1, False),
    "moe_bf16_wide_decode": ("bfloat16", False, 1, False, True),
    "moe_bf16_flag_s1": ("bfloat16", True, 1, False),
    "moe_bf16_flag_s2": ("bfloat16", True, 2, False),
    "moe_bf16_flag_s4": ("bfloat16", True, 4, False),
    "moe_bf16_flag_s8": ("bfloat16", True, 8, False),
    "moe_bf16_tma": ("bfloat16", False, 1, True),
    "moe_bf16_tma_flag_s4": ("bfloat16", True, 4, True),
    "moe_fp32": ("float32", False, 1, False),
}
# Qwen3-30B-A3B's attention: 32 query heads over 4 KV heads of 128, blocks of 16 positions.
ATTENTION = dict(M=4, G=8, D=128, block_size=16, dtype=torch.bfloat16)
ATTENTION_CASES = {
    "attention_decode": dict(decode_lens=(40, 300, 17)),
    "attention_decode_split": dict(decode_lens=(40, 300, 17), num_splits=4),
    "attention_mixed": dict(decode_lens=(40, 300), prefill=((200, 64), (33, 33))),
}


# --------------------------------------------------------------------------------- the compile-only driver
def install_compile_only_driver(compiled: list[dict]) -> None:
    """Make Triton compile for sm_90a and launch nothing: each kernel it would load is appended to `compiled`
    (its name, shared memory, pipeline stages, whether it fitted, and its cubin's registers and stack)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime import driver

    class Utils:
        def get_device_properties(self, device):
            return {"max_shared_mem": SHARED_MEM_PER_BLOCK, "multiprocessor_count": SMS}

        def load_binary(self, name, cubin, shared, device):
            usage = resource_usage(cubin)
            compiled[-1].update(usage, loaded=True)
            return object(), object(), usage["registers"], usage["stack"], MAX_THREADS_PER_BLOCK

        def unload_module(self, module):
            pass

    class CompileOnly(DriverBase):
        utils = Utils()

        @classmethod
        def is_active(cls):
            return True

        def launcher_cls(self, src, metadata):
            # Triton asks for the launcher first, then checks the shared memory and loads the binary: a kernel
            # over the limit stays loaded=False (`_launch_fitting` then retries it with fewer stages)
            compiled.append(
                {
                    "kernel": metadata.name,
                    "shared": metadata.shared,
                    "stages": metadata.num_stages,
                    "loaded": False,
                }
            )
            return lambda *args, **kwargs: None

        def map_python_to_cpp_type(self, ty):
            return ty

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("compile only: nothing runs")

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            return torch.cuda

    driver.set_active(CompileOnly())


def resource_usage(cubin: bytes) -> dict:
    """Registers and stack bytes (where spilled registers go) per thread, from `cuobjdump -res-usage` (Triton's own
    copy) over the cubin."""
    from triton.backends.nvidia import compiler as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return {"registers": int(regs.group(1)), "stack": int(stack.group(1))}


# ---------------------------------------------------------------------------------------------- the cases
def compile_moe(dtype: str, flagged: bool, slices: int, tma: bool, decode_only: bool = False) -> None:
    """The launches of `persistent_moe_run` (tile table, phase A, phase B, combine) on CPU tensors, with the tile
    heights and launch options it picks for the pass."""
    from test_persistent_moe import make_inputs

    from rollout.kernels import persistent_moe as pm

    x = make_inputs({**MOE, "dtype": dtype})
    flag = torch.zeros(1, dtype=torch.int32) if flagged else None
    (t, k), e, f = x["ids_TK"].shape, x["gate_up_EFH"].shape[0], x["gate_up_EFH"].shape[1] // 2
    nd = t if decode_only else MOE["num_decode"]
    block_m_decode = pm.decode_block_m(nd, k, e)
    blocks = (block_m_decode, pm.BLOCK_M_PREFILL, pm.BLOCK_N, pm.BLOCK_K)
    pm.build_tiles(x["ids_TK"], nd, e, block_m_decode, kernel=True)
    run = pm._new_run(x["h_TH"], x["ids_TK"], e, f, nd, flagged, blocks, tma)
    pm._launch_run(
        run, x["h_TH"], x["weights_TK"], x["residual_TH"], nd, x["gate_up_EFH"], x["down_EHF"],
        flag, pm.PROGRAMS_PER_SM * SMS, pm.launch_options(t, nd, block_m_decode), None, slices,
    )  # fmt: skip


def compile_attention(spec: dict) -> None:
    from test_paged_attention import make_case

    from rollout import paged_attention as pa

    case = make_case(**ATTENTION, **spec)
    tiles = {"decode_key_tile": pa.DECODE_KEY_TILE, "prefill_key_tile": pa.PREFILL_KEY_TILE}
    case.run(lambda *args: pa.paged_attention_triton(*args, **tiles))


def compile_all() -> dict[str, dict]:
    """Per case {"kernels": what Triton would load, in launch order} or {"error": why it did not compile}. The
    in-process caches are emptied between cases so that each case loads every kernel it launches (Triton's disk
    cache makes the repeats cheap)."""
    from rollout import paged_attention
    from rollout.kernels import persistent_moe

    log: list[dict] = []
    install_compile_only_driver(log)
    jitted = [
        fn
        for module in (persistent_moe, paged_attention)
        for fn in vars(module).values()
        if type(fn).__name__ == "JITFunction"
    ]
    cases = {name: (compile_moe, args) for name, args in MOE_CASES.items()}
    cases |= {name: (compile_attention, (spec,)) for name, spec in ATTENTION_CASES.items()}
    results = {}
    for name, (fn, args) in cases.items():
        for kernel in jitted:
            kernel.device_caches.clear()
        persistent_moe._FITTING_STAGES.clear()
        start = len(log)
        try:
            fn(*args)
        except Exception as error:  # a case that does not compile is reported, the others still run
            results[name] = {"error": f"{type(error).__name__}: {error}"[-3000:]}
            continue
        results[name] = {"kernels": log[start:]}
    return results


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not importable")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU tests compile and run the kernels")
    from triton.backends.nvidia import compiler as nvidia

    tools = Path(nvidia.__file__).parent / "bin"
    if not all((tools / tool).exists() for tool in ("ptxas", "cuobjdump")):
        pytest.skip(f"Triton's CUDA backend has no ptxas and cuobjdump in {tools}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


MOE_KERNELS = ["_tile_table_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel"]


def case_kernels(compiled: dict, name: str) -> tuple[list[dict], list[dict]]:
    """(every kernel the case compiled, those that loaded); fails with the compiler's message if it did not."""
    case = compiled[name]
    assert "error" not in case, f"{name} does not compile for sm_90a:\n{case.get('error')}"
    return case["kernels"], [k for k in case["kernels"] if k["loaded"]]


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE_CASES)
def test_persistent_moe_launches_compile_for_sm90(compiled, name):
    from rollout.kernels.persistent_moe import LAUNCH, WIDE_DECODE_LAUNCH

    every, kernels = case_kernels(compiled, name)
    assert [k["kernel"] for k in kernels] == MOE_KERNELS
    assert all(k["shared"] <= SHARED_MEM_PER_BLOCK and k["registers"] > 0 for k in kernels)
    if MOE_CASES[name][0] == "bfloat16":  # the defaults are sized for bf16 tiles: no launch falls back
        assert every == kernels
        stages = (WIDE_DECODE_LAUNCH if MOE_CASES[name][4:] == (True,) else LAUNCH)["num_stages"]
        assert [k["stages"] for k in kernels[1:3]] == [stages, stages]


@pytest.mark.slow
def test_fp32_tiles_fall_back_to_a_pipeline_that_fits(compiled):
    """fp32 tiles need twice bf16's bytes a stage: Triton refuses phase A's default depth when it loads the kernel,
    before anything runs, and `_launch_fitting` compiles it again one stage shallower."""
    from rollout.kernels.persistent_moe import NUM_STAGES

    gate_up = [k for k in case_kernels(compiled, "moe_fp32")[0] if k["kernel"] == "_gate_up_kernel"]
    assert [(k["stages"], k["loaded"]) for k in gate_up] == [(NUM_STAGES, False), (NUM_STAGES - 1, True)]
    assert gate_up[0]["shared"] > SHARED_MEM_PER_BLOCK >= gate_up[1]["shared"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_paged_attention_launches_compile_for_sm90(compiled, name):
    every, kernels = case_kernels(compiled, name)
    spec = ATTENTION_CASES[name]
    want = ["_decode_kernel"] + (["_combine_kernel"] if spec.get("num_splits", 1) > 1 else [])
    want += ["_prefill_kernel"] if spec.get("prefill") else []
    assert [k["kernel"] for k in kernels] == want
    assert every == kernels
    assert all(k["shared"] <= SHARED_MEM_PER_BLOCK and k["registers"] > 0 for k in kernels)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    print(json.dumps(compile_all()))
