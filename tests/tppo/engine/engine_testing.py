"""Helpers for the engine tests: tiny Hugging Face MoE checkpoints and multi-process gloo runs."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch

_PRELOAD = ["torch", "tppo.engine.engine", "tppo.engine.convert"]


def make_hf_checkpoint(
    path: str,
    arch: str,
    *,
    seed: int = 0,
    num_layers: int = 2,
    first_k_dense: int = 0,
    tie: bool = False,
    vocab: int = 96,
) -> str:
    """Save a tiny random Qwen3-MoE or Mixtral checkpoint made by transformers itself (fp32)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts_per_tok=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        initializer_range=0.1,
    )
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=4,
            norm_topk_prob=True,
            mlp_only_layers=list(range(first_k_dense)),
            decoder_sparse_step=1,
            rope_theta=10000.0,
            **common,
        )
        model = Qwen3MoeForCausalLM(cfg)
    else:
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(intermediate_size=16, num_local_experts=4, rope_theta=1e6, **common)
        model = MixtralForCausalLM(cfg)
    model.save_pretrained(path)
    return path


def _child(target: Callable, rank: int, world: int, port: int, args: tuple, results) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        # Plain bytes through the queue: tensors would travel as shared-memory handles that die with us.
        buf = io.BytesIO()
        torch.save(target(rank, *args), buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(target: Callable, world: int, *args: Any, timeout_s: float = 240.0) -> list[Any]:
    """Run target(rank, *args) in `world` fresh processes joined over gloo (NCCL, one GPU each, on a CUDA host);
    return the results by rank.

    On CPU, processes fork from a forkserver that imported torch and the engine once; on a CUDA host they are
    spawned. A failure in any rank, or a run past `timeout_s`, raises with the ranks' tracebacks; nothing is left
    running.
    """
    from tppo.engine.parallel import reserved_port

    if torch.cuda.is_available():
        # One GPU per rank over NCCL: a forked child cannot initialise CUDA ("Cannot re-initialize CUDA in forked
        # subprocess", seen with the forkserver on a GPU host), so the ranks start fresh.
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    with reserved_port() as port:  # held until every rank has joined (and the run is over)
        procs = [
            ctx.Process(target=_child, args=(target, r, world, port, args, results), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors = []
        try:
            for _ in range(world):
                rank, status, value = results.get(timeout=timeout_s)
                if status == "error":
                    errors.append(f"rank {rank}:\n{value}")
                    break
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        except queue.Empty:
            errors.append(f"ranks {sorted(set(range(world)) - set(out))} did not finish within {timeout_s} s")
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [out[r] for r in range(world)]


def nll_loss(out, batch):
    """Token-mean negative log-likelihood of a micro-batch (the engine tests' loss callable)."""
    from tppo.engine.batch import LossOutput

    lp = out.logprobs_BT
    return LossOutput(loss_sum=-lp.sum(), denominator=lp.numel())


def ep_parity_worker(
    rank: int, ckpt: str, batches: list, replay_ids: list, logit_ids: list, export_dir: str
) -> dict:
    """One rank of an EP=2 engine (world 2, so data parallel 2): everything the parity test compares."""
    from tppo.engine import convert
    from tppo.engine.batch import TrainBatch
    from tppo.engine.config import OptimConfig, ParallelConfig
    from tppo.engine.convert import model_config_from_hf
    from tppo.engine.engine import MegatronEngine

    read: list[str] = []
    original_get = convert.HFReader.get
    convert.HFReader.get = lambda self, name, shape: read.append(name) or original_get(self, name, shape)
    try:
        engine = MegatronEngine(
            model_config_from_hf(ckpt), ParallelConfig(expert_parallel=2), OptimConfig(lr=1e-3, grad_clip=0.0)
        )
    finally:
        convert.HFReader.get = original_get
    experts_read = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n})
    batch = batches[rank]
    engine.ddp.eval()
    with torch.no_grad():
        # A direct model call bypasses the engine's padding: equal shapes on both ranks here.
        logits = engine.module(logit_ids[rank], None, None).clone()
    rec = engine.forward([batch], with_entropy=True, record_routing=True)[0]
    replayed = engine.forward(
        [TrainBatch(input_ids_BT=batch.input_ids_BT, routed_experts_BTLK=rec.routed_experts_BTLK)],
        with_entropy=True,
    )[0]
    engine.forward([TrainBatch(input_ids_BT=batch.input_ids_BT, routed_experts_BTLK=replay_ids[rank])])
    counts = [layer.experts.last_tokens_per_expert.clone() for layer in engine.moe_layers]
    loss, _ = engine.forward_backward([batch], nll_loss)
    grads = {n: g.clone() for n, g in engine.named_grads().items()}
    engine.optimizer_step()
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.export_hf(export_dir)
    return dict(
        logits=logits,
        logprobs=rec.logprobs_BT,
        entropy=rec.entropy_BT,
        routed=rec.routed_experts_BTLK,
        replayed_logprobs=replayed.logprobs_BT,
        replayed_entropy=replayed.entropy_BT,
        counts=counts,
        loss=loss,
        grads=grads,
        params=params,
        expert_ids=[list(layer.experts.logical_expert_ids) for layer in engine.moe_layers],
        experts_read=experts_read,
    )


def hf_gradients(engine) -> dict:
    """This stage's reduced gradients in Hugging Face names and layout (logical expert order).

    The weights are swapped for their gradients while the exporter runs: every conversion step (TP
    gathers, q/k/v split, expert gathers) is linear, so it maps gradients exactly as it maps weights.
    """
    from tppo.engine.convert import iter_hf_tensors

    saved, grads = {}, engine.named_grads()
    for name, p in engine.module.named_parameters():
        saved[name] = p.data
        p.data = grads[name].to(p.dtype)
    try:
        return {n: t.clone() for n, t in iter_hf_tensors(engine.built, engine.groups)}
    finally:
        for name, p in engine.module.named_parameters():
            p.data = saved[name]


def layout_worker(
    rank: int, ckpt: str, replica_batches: list, tp: int, pp: int, ep: int, export_dir: str
) -> dict:
    """One rank of a TP/PP/EP layout: outputs, loss and HF-layout gradients of its data-parallel replica,
    after exporting the (untrained) weights back to HF safetensors."""
    from tppo.engine.config import OptimConfig, ParallelConfig
    from tppo.engine.convert import model_config_from_hf
    from tppo.engine.engine import MegatronEngine

    parallel = ParallelConfig(
        tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep, sequence_parallel=tp > 1
    )
    engine = MegatronEngine(model_config_from_hf(ckpt), parallel, OptimConfig(lr=1e-3))
    engine.export_hf(export_dir, dtype=torch.float32, max_shard_bytes=50_000)
    batches = replica_batches[engine.groups.dp_rank]
    outs = engine.forward(batches, with_entropy=True, record_routing=True)
    # forward_backward, keeping the training forward's log-probs (train_step(keep_logprobs=True) without the
    # optimizer step, which would scale the gradients read below)
    loss, _, kept = engine._forward_backward(batches, nll_loss, require_replay=False, keep_logprobs=True)
    return dict(
        dp_rank=engine.groups.dp_rank,
        pp_rank=engine.groups.pp_rank,
        loss=loss,
        logprobs=[o.logprobs_BT for o in outs],
        kept=[o.logprobs_BT for o in kept],
        entropy=[o.entropy_BT for o in outs],
        routed=[o.routed_experts_BTLK for o in outs],
        grads=hf_gradients(engine),
    )


def replay_worker(rank: int, ckpt: str, sequences: list) -> list:
    """One rank of an EP=2 engine (world 2): for each (token ids, rollout routes [T, L, K], temperature), the
    experts its own router picks and the log-probs under the replayed routes (both ranks run every sequence)."""
    from tppo.engine.batch import TrainBatch
    from tppo.engine.config import OptimConfig, ParallelConfig
    from tppo.engine.convert import model_config_from_hf
    from tppo.engine.engine import MegatronEngine

    engine = MegatronEngine(
        model_config_from_hf(ckpt), ParallelConfig(expert_parallel=2), OptimConfig(), optimizer="none"
    )
    out = []
    for ids, routes, temperature in sequences:
        batch = TrainBatch(input_ids_BT=torch.tensor([ids]), temperature=temperature)
        recorded = engine.forward([batch], record_routing=True)[0].routed_experts_BTLK[0]
        replay = TrainBatch(
            input_ids_BT=torch.tensor([ids]), routed_experts_BTLK=routes[None], temperature=temperature
        )
        logprobs = engine.forward([replay], require_replay=True)[0].logprobs_BT[0]
        out.append((recorded.long().cpu(), logprobs.cpu()))
    return out
