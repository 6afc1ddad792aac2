"""Every experiment composes and validates; bad overrides end with one message naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from recipes._hydra import CONFIG_DIR, compose
from tppo.config import ConfigError, ExperimentConfig

EXPERIMENTS = sorted(p.stem for p in Path(CONFIG_DIR, "experiment").glob("*.yaml"))
GROUPS = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in Path(CONFIG_DIR).iterdir() if g.is_dir()}


def test_there_are_experiments_and_groups():
    assert {"default", "qwen3_30b_a3b_tppo", "mixtral_8x7b_tppo"} <= set(EXPERIMENTS)
    assert {"model", "algo", "rollout", "relibra", "data", "cluster", "logging", "experiment"} <= set(GROUPS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_validates(name):
    cfg = compose("train", [f"experiment={name}"])
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.run.name == name


@pytest.mark.parametrize(
    ("group", "option"), [(g, o) for g, opts in GROUPS.items() if g != "experiment" for o in opts]
)
def test_every_group_option_composes_over_the_schema(group, option):
    # Real-model groups need a cluster that can hold them; validation of those runs through their experiments.
    overrides = [f"{group}={option}"]
    if group == "parallel" and option.endswith("gpu"):
        overrides += [
            "cluster=slurm_4x8",
            "model=qwen3_30b_a3b" if "qwen" in option else "model=mixtral_8x7b",
            "relibra.gpus_per_node=8",
        ]
    if group == "cluster" and option == "slurm_4x8":
        overrides += ["parallel=qwen3_30b_a3b_32gpu", "model=qwen3_30b_a3b", "relibra.gpus_per_node=8"]
    if group == "algo" and option in ("ppo", "grpo"):
        overrides += ["algo.window=64"]  # whole responses; the default experiment's windows need egae
    if group == "data" and option != "synthetic":
        overrides += ["data.max_prompt_length=32"]  # the tiny default model holds 128 tokens
    if group == "cluster" and option == "single_gpu":
        overrides += ["parallel=single"]
    if group == "model" and option in ("qwen3_30b_a3b", "mixtral_8x7b"):
        overrides += ["parallel=single", "cluster.policy_ranks=1", "relibra.gpus_per_node=1"]
    compose("train", overrides)


def test_default_experiment_values():
    cfg = compose("train")
    assert cfg.parallel.expert_parallel == 2 and cfg.cluster.policy_ranks == 2
    assert cfg.algo.window < cfg.algo.max_response_length  # several windows per long response
    assert cfg.data.source == "synthetic"


def test_typed_values_arrive_as_python_types():
    cfg = compose("train", ["algo.window=32", "algo.actor_optim.lr=3e-4", "logging=disabled"])
    assert cfg.algo.window == 32 and isinstance(cfg.algo.window, int)
    assert cfg.algo.actor_optim.lr == pytest.approx(3e-4)
    assert cfg.logging.wandb == "disabled"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("algo.window=0", "algo.window=0 is not allowed: expected a value >= 1"),
        (
            "algo.estimator=vtrace",
            "algo.estimator='vtrace' is not allowed: expected one of 'egae', 'gae', 'grpo'",
        ),
        ("model.moe_topk=9", "model.moe_topk=9 exceeds model.num_experts=8"),
        ("parallel.expert_parallel=3", "parallel.expert_parallel=3 must divide"),
        ("algo.batch_size=10", "algo.batch_size=10 must be a multiple of algo.group_size=4"),
        ("model.hidden_sizee=3", "unknown key 'model.hidden_sizee'"),
        ("run.device=cuda", "run.device=cuda needs cluster.gpus_per_node >= 1"),
        ("algo.mini_batches=0", "algo.mini_batches=0 is not allowed: expected a value >= 1"),
        ("algo.epochs=0", "algo.epochs=0 is not allowed: expected a value >= 1"),
        ("algo.dynamic_sampling=true", "algo.dynamic_sampling needs whole responses"),
        ("+algo.windw=4", "unknown key 'algo.windw': .* did you mean algo.window?"),
        ("++algo.windw=4", "unknown key 'algo.windw'"),
        ("run.name=../../x", "run.name='../../x' must be a plain name"),
        ("run.name=a/b", "run.name='a/b' must be a plain name"),
        (
            "backend.policy.engine=deepspeed",
            "backend.policy.engine=deepspeed cannot run relibra.enabled=true",
        ),
        (
            "backend.critic.offload_param=true",
            "backend.critic.offload_param=true needs backend.critic.zero_stage=3",
        ),
        ("backend.critic.engine=deepspeedd", "backend.critic.engine='deepspeedd'"),
    ],
)
def test_bad_values_raise_config_error_naming_the_key(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        compose("train", [override])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["algo.old_logprobs=update", "algo.mini_batches=2"],
            "algo.old_logprobs=update needs one optimizer step per update (algo.mini_batches=2, algo.epochs=1)",
        ),
        (["algo.old_logprobs=update", "algo.epochs=3"], "(algo.mini_batches=1, algo.epochs=3)"),
        (
            ["algo.old_logprobs=update", "algo.routing_replay=r2"],
            "algo.old_logprobs=update cannot run with algo.routing_replay=r2",
        ),
    ],
)
def test_old_logprobs_from_the_update_refuse_updates_of_several_steps_and_r2(overrides, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        compose("train", overrides)


def test_overlapped_updates_need_roles_that_do_not_time_share_devices():
    assert compose("train", ["cluster.overlap_updates=on"]).cluster.overlapped_updates
    with pytest.raises(
        ConfigError, match=r"cluster.overlap_updates=on needs roles that do not time-share .*offload=on"
    ):
        compose("train", ["cluster.overlap_updates=on", "cluster.offload=on"])
    # auto: on for GPU runs whose roles do not time-share, off on CPU and where they do
    assert not compose("train", []).cluster.overlapped_updates
    gpu = ["cluster=single_gpu", "parallel=single"]
    assert not compose("train", gpu).cluster.overlapped_updates
    assert compose("train", [*gpu, "cluster.offload=off"]).cluster.overlapped_updates
    assert not compose(
        "train", [*gpu, "cluster.offload=off", "cluster.overlap_updates=off"]
    ).cluster.overlapped_updates


def test_old_logprobs_auto_come_from_a_one_step_update_without_r2():
    assert compose("train", []).algo.old_logprobs_from_update
    assert compose("train", ["algo.old_logprobs=update"]).algo.old_logprobs_from_update
    for overrides in (
        ["algo.epochs=2"],
        ["algo.mini_batches=2"],
        ["algo.routing_replay=r2"],
        ["algo.old_logprobs=pass"],
    ):
        assert not compose("train", overrides).algo.old_logprobs_from_update, overrides


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recipes.check", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(CONFIG_DIR).parent,
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["experiment=does_not_exist"], "Could not find 'experiment/does_not_exist'"),
        (["model.hidden_sizee=3"], "did you mean model.hidden_size?"),
        (["model.hidden_size=abc"], "model.hidden_size"),
        (["algo.lam=1.5"], "algo.lam=1.5 is not allowed: expected a value >= 0 and <= 1"),
    ],
)
def test_cli_bad_override_is_one_message_without_traceback(args, expected):
    result = _check(*args)
    assert result.returncode != 0
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_prints_the_validated_config():
    result = _check("experiment=qwen3_30b_a3b_tppo")
    assert result.returncode == 0, result.stderr
    assert '"num_experts": 128' in result.stdout


def test_deepspeed_backends_compose_and_refuse_model_parallel_policies():
    cfg = compose("train", ["experiment=critic_deepspeed"])
    assert cfg.backend.critic.engine == "deepspeed" and cfg.backend.policy.engine == "megatron"
    with pytest.raises(
        ConfigError, match=r"runs data parallel only: parallel.expert_parallel=2 needs megatron"
    ):
        compose("train", ["backend.policy.engine=deepspeed", "relibra.enabled=false"])
    policy = compose("train", ["backend.policy.engine=deepspeed", "relibra.enabled=false", "parallel=single"])
    assert policy.backend.policy.engine == "deepspeed"
