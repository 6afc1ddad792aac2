"""HF <-> Megatron conversion: logits equal transformers' own model, round trips are bit-identical, bad
checkpoints and unsupported architectures fail with messages that name the problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from engine_testing import make_hf_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from tppo.engine.batch import TrainBatch
from tppo.engine.config import OptimConfig, ParallelConfig
from tppo.engine.convert import (
    HFReader,
    convert_checkpoint,
    hf_config_dict,
    iter_hf_weights,
    model_config_from_hf,
)
from tppo.engine.engine import MegatronEngine

pytestmark = pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex).*:UserWarning")

CASES = {
    "qwen3_moe": dict(arch="qwen3_moe", first_k_dense=1, num_layers=3),
    "qwen3_moe_tied": dict(arch="qwen3_moe", tie=True),
    "mixtral": dict(arch="mixtral"),
}


def _tensors(path: str) -> dict[str, torch.Tensor]:
    reader = HFReader(path)
    out = {}
    for name, fname in reader.weight_map.items():
        with safe_open(os.path.join(path, fname), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_logits_match_transformers(tmp_path, case):
    from transformers import AutoModelForCausalLM

    ckpt = make_hf_checkpoint(str(tmp_path / case), **CASES[case])
    m = model_config_from_hf(ckpt)
    engine = MegatronEngine(m, ParallelConfig(), OptimConfig())
    torch.manual_seed(3)
    ids = torch.randint(0, m.vocab_size, (2, 11))
    engine.ddp.eval()
    with torch.no_grad():
        ours = engine.module(ids, None, None)
        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        ref = hf(ids).logits
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4
    logprobs = engine.forward([TrainBatch(input_ids_BT=ids)])[0].logprobs_BT
    ref_lp = torch.log_softmax(ref[:, :-1].double(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert (logprobs[:, 1:] - ref_lp).abs().max().item() <= 1e-4
    assert torch.all(logprobs[:, 0] == 0)


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_identical(tmp_path, case, dtype):
    src = make_hf_checkpoint(str(tmp_path / "src"), **CASES[case])
    if dtype != torch.float32:
        bf = {k: v.to(dtype) for k, v in _tensors(src).items()}
        os.remove(os.path.join(src, "model.safetensors"))
        save_file(bf, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    dst = str(tmp_path / "dst")
    convert_checkpoint(src, dst, ep=1, max_shard_bytes=20_000)  # small shards: several files plus an index
    before, after = _tensors(src), _tensors(dst)
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert after[name].dtype == t.dtype, name
        assert torch.equal(after[name], t), name
    assert len({f for f in HFReader(dst).weight_map.values()}) > 1
    with open(os.path.join(src, "config.json")) as a, open(os.path.join(dst, "config.json")) as b:
        assert json.load(a) == json.load(b)


def test_cli_round_trip_in_process(tmp_path):
    from tppo.convert import main

    src = make_hf_checkpoint(str(tmp_path / "src"), "mixtral")
    main(["--from-hf", src, "--to-hf", str(tmp_path / "out"), "--ep", "1"])
    before, after = _tensors(src), _tensors(str(tmp_path / "out"))
    assert all(torch.equal(after[k], v) for k, v in before.items()) and sorted(before) == sorted(after)


def test_engine_export_loads_in_transformers_and_buckets_cover_all(tmp_path):
    from transformers import AutoModelForCausalLM

    src = make_hf_checkpoint(str(tmp_path / "src"), "qwen3_moe", first_k_dense=1, num_layers=3)
    engine = MegatronEngine(model_config_from_hf(src), ParallelConfig(), OptimConfig())
    engine.export_hf(str(tmp_path / "exp"))
    ids = torch.randint(0, 96, (1, 7))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exp"), dtype=torch.float32)(ids).logits
    assert torch.equal(a, b)
    src_tensors = _tensors(src)
    bucket_bytes = 30_000
    buckets = list(iter_hf_weights(engine, bucket_bytes=bucket_bytes))
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= bucket_bytes or len(bucket) == 1
    names = [n for bucket in buckets for n, _ in bucket]
    assert sorted(names) == sorted(src_tensors) and len(names) == len(set(names))
    assert all(torch.equal(t, src_tensors[n]) for bucket in buckets for n, t in bucket)
    expert_names = [n for n in names if ".experts." in n and n.startswith("model.layers.1.")]
    assert [int(n.split(".experts.")[1].split(".")[0]) for n in expert_names[::3]] == [0, 1, 2, 3]


def _rewrite(src: str, dst: str, change) -> str:
    tensors = _tensors(src)
    change(tensors)
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())
    return dst


def test_missing_tensor_names_tensor_and_shape(tmp_path):
    src = make_hf_checkpoint(str(tmp_path / "src"), "qwen3_moe")
    bad = _rewrite(src, str(tmp_path / "bad"), lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(
        ValueError,
        match=r"no tensor 'model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight' "
        r"\(expected shape \(16, 32\)\)",
    ):
        MegatronEngine(model_config_from_hf(bad), ParallelConfig(), OptimConfig())


def test_misshaped_tensor_names_tensor_and_shapes(tmp_path):
    src = make_hf_checkpoint(str(tmp_path / "src"), "mixtral")

    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:8]

    bad = _rewrite(src, str(tmp_path / "bad"), shrink)
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' .* has shape \(8, 32\); "
        r"expected \(16, 32\)",
    ):
        MegatronEngine(model_config_from_hf(bad), ParallelConfig(), OptimConfig())


def test_cli_bad_checkpoint_is_one_error_line_and_leaves_no_output(tmp_path):
    """python -m tppo.convert on a misshaped checkpoint: one `error:` line naming the tensor, exit status 2, and the
    output folder it would have created is gone (it used to print a 58-line traceback and leave the folder)."""
    src = make_hf_checkpoint(str(tmp_path / "src"), "mixtral")

    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:8]

    bad = _rewrite(src, str(tmp_path / "bad"), shrink)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "tppo.convert", "--from-hf", bad, "--to-hf", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "model.layers.0.self_attn.k_proj.weight" in lines[0] and "(8, 32)" in lines[0]
    assert not out.exists()


def test_unsupported_architecture_lists_supported(tmp_path):
    path = tmp_path / "llama"
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    with pytest.raises(ValueError, match="supported: MixtralForCausalLM, Qwen3MoeForCausalLM"):
        model_config_from_hf(str(path))
    with pytest.raises(ValueError, match="supported: MixtralForCausalLM, Qwen3MoeForCausalLM"):
        convert_checkpoint(str(path), str(tmp_path / "out"))
    from tppo.engine.config import ModelConfig

    with pytest.raises(ValueError, match="supported: qwen3_moe, mixtral"):
        MegatronEngine(ModelConfig(arch="gpt2"), ParallelConfig(), OptimConfig())


def test_config_mismatch_is_reported(tmp_path):
    from dataclasses import replace

    src = make_hf_checkpoint(str(tmp_path / "src"), "qwen3_moe")
    m = replace(model_config_from_hf(src), num_experts=8)
    with pytest.raises(ValueError, match="num_experts: model 8 vs checkpoint 4"):
        MegatronEngine(m, ParallelConfig(), OptimConfig())


def test_generated_config_reloads_to_same_model_config(tmp_path):
    src = make_hf_checkpoint(str(tmp_path / "src"), "qwen3_moe", first_k_dense=1, num_layers=3)
    m = model_config_from_hf(src)
    out = tmp_path / "gen"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config_dict(m)))
    again = model_config_from_hf(str(out))
    for field in (
        "arch",
        "num_experts",
        "moe_topk",
        "first_k_dense",
        "head_dim",
        "ffn_hidden_size",
        "moe_ffn_hidden_size",
        "rope_theta",
        "norm_topk_prob",
        "num_query_groups",
    ):
        assert getattr(again, field) == getattr(m, field), field
