"""The product's premise on one set of weights: the rollout engine and the Megatron trainer (EP 1, fp32, CPU) route
every token to the same experts, and under the rollout's replayed routing the trainer's log-probs of the sampled
tokens equal the rollout's, at T = 1 and T = 0.7, for a first window and its continuation."""

from __future__ import annotations

import pytest
import torch
from engine_testing import make_hf_checkpoint, replay_worker, run_ranks

from rollout.config import RolloutConfig
from rollout.engine import RolloutEngine
from rollout.params import SamplingParams
from tppo.engine.batch import TrainBatch
from tppo.engine.config import OptimConfig, ParallelConfig
from tppo.engine.convert import model_config_from_hf
from tppo.engine.engine import MegatronEngine

pytestmark = pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex).*:UserWarning")

WINDOW = 6


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def engines(request, tmp_path_factory):
    ckpt = make_hf_checkpoint(str(tmp_path_factory.mktemp("cross") / request.param), request.param)
    rollout = RolloutEngine.from_pretrained(
        ckpt, "cpu", "float32", RolloutConfig(max_model_len=64, kv_cache_tokens=1024, cuda_graphs=False)
    )
    trainer = MegatronEngine(model_config_from_hf(ckpt), ParallelConfig(), OptimConfig(), optimizer="none")
    return rollout, trainer


def _windows(rollout: RolloutEngine, prompt: list[int], temperature: float, seed: int):
    """A first window, then its continuation (a new request on prompt + the first window, as the pool makes it)."""
    params = SamplingParams(max_new_tokens=WINDOW, temperature=temperature, seed=seed, ignore_eos=True)
    first = rollout.generate([prompt], params)[0]
    second = rollout.generate([prompt + first.token_ids], params)[0]
    return first, second


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_routes_like_the_rollout_and_replays_to_its_logprobs(engines, temperature):
    rollout, trainer = engines
    g = torch.Generator().manual_seed(11)
    for seed in range(3):
        prompt = torch.randint(1, 90, (5,), generator=g).tolist()
        for out in _windows(rollout, prompt, temperature, seed):
            ids = out.prompt_token_ids + out.token_ids
            n, new = len(ids), len(out.token_ids)
            routes_TLK = torch.as_tensor(out.routed_experts[:n].astype("int64"))
            assert routes_TLK.shape[0] == n  # the last sampled token was routed too
            batch = TrainBatch(input_ids_BT=torch.tensor([ids]), temperature=temperature)
            # (a) the trainer's own router picks the rollout's experts for every token (as sets: top-k order aside)
            recorded = trainer.forward([batch], record_routing=True)[0].routed_experts_BTLK[0].long().cpu()
            torch.testing.assert_close(recorded.sort(-1).values, routes_TLK.sort(-1).values, rtol=0, atol=0)
            # (b) replaying the rollout's routing, the trainer scores the sampled tokens as the rollout did
            replayed = TrainBatch(
                input_ids_BT=torch.tensor([ids]),
                routed_experts_BTLK=routes_TLK[None],
                temperature=temperature,
            )
            logprobs = trainer.forward([replayed], require_replay=True)[0].logprobs_BT[0, n - new :].cpu()
            torch.testing.assert_close(logprobs, torch.as_tensor(out.logprobs).float(), rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.dist
def test_two_expert_parallel_ranks_route_and_replay_like_the_rollout(engines):
    """The same at EP 2 (two gloo ranks, each holding half of the experts)."""
    rollout, trainer = engines
    g = torch.Generator().manual_seed(12)
    cases, expected = [], []
    for seed, temperature in enumerate((1.0, 0.7)):
        prompt = torch.randint(1, 90, (5,), generator=g).tolist()
        for out in _windows(rollout, prompt, temperature, seed):
            ids = out.prompt_token_ids + out.token_ids
            routes = torch.as_tensor(out.routed_experts[: len(ids)].astype("int64"))
            cases.append((ids, routes, temperature))
            expected.append((routes, torch.as_tensor(out.logprobs).float(), len(out.token_ids)))
    for rank_results in run_ranks(replay_worker, 2, trainer.model_cfg.hf_path, cases):
        for (recorded, logprobs), (routes, rollout_lp, new) in zip(rank_results, expected, strict=True):
            torch.testing.assert_close(recorded.sort(-1).values, routes.sort(-1).values, rtol=0, atol=0)
            torch.testing.assert_close(logprobs[-new:], rollout_lp, rtol=0, atol=1e-5)
