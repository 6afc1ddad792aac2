"""Deployment planner of the rollout engine: `python -m rollout.plan`.

Decode (issue #30, MegaScale-Infer, arXiv 2504.02263): given a model shape, GPUs, context lengths, links and
optionally a per-token latency target, choose between the replicas layout (every GPU group holds all weights and
its own KV cache) and the disaggregated layout (attention workers with the KV cache, expert workers with the
experts, m ping-pong micro-batches), with section 4.1's iteration time and section 4.2's Algorithm 1 over
per-layer times from a measured profile (`bench/rollout_disagg.py --profile`) or a GPU preset's roofline.

Shared (issue #29, ExpertPlex, arXiv 2607.18002, section 6): prefill-attention and decode-attention pools and one
shared expert pool, goodput = min(prefill rate, decode rate at the SLO), MoE cost in tiles; compared with
per-phase replicas (prefill/decode disaggregation) and colocation.

Modules: hardware (GPU and model presets, byte counts), perf (the papers' formulas), profile (profile JSON, fits,
roofline times), search (Algorithm 1, replicas, brute force), shared (ExpertPlex), report (tables, --validate), schedule (an
engine's step schedule on one GPU at the roofline).
Departures from the papers are listed in each module's docstring.
"""

from rollout.plan.hardware import GPU_PRESETS, MODEL_PRESETS, GpuSpec, ModelShape, gpu_preset, model_preset
from rollout.plan.profile import LayerTimes, Profile, analytic_times, fitted_times, load_profile
from rollout.plan.search import Cluster, Plan, Search, Shape, Workload, brute_force, search_plans

__all__ = [
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "Cluster",
    "GpuSpec",
    "LayerTimes",
    "ModelShape",
    "Plan",
    "Profile",
    "Search",
    "Shape",
    "Workload",
    "analytic_times",
    "brute_force",
    "fitted_times",
    "gpu_preset",
    "load_profile",
    "model_preset",
    "search_plans",
]
