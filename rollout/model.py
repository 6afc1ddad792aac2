"""The forward pass of a Qwen3-MoE / Mixtral decoder over the paged KV cache: one engine step is a flat batch of
tokens (decode rows, one token each, then chunks of prompts being prefilled), every shape fixed by the step's
token count so a CUDA graph can capture it.

Numerics follow transformers' modeling code (RMSNorm in fp32, RoPE tables in fp32 cast to the model dtype,
router softmax in fp32, top-k then optional renormalisation), so greedy tokens, log-probs and routing match it.
The experts run as two `torch._grouped_mm` calls over the routed (token, expert) pairs sorted by expert (a stable
sort on int16 expert ids: a quarter of the radix passes of int64 keys, the same order); GPU batches with 8-64
pairs per expert instead run dense `torch.bmm` over a fixed number of rows per expert plus grouped GEMMs over
the pairs that do not fit (`padded_rows`, `_padded_ffn`, `padded_capacity`). The weighted sum over the k experts
of a token is one batched matmul (deterministic, unlike an atomic index_add). `expert_kernel="persistent"` runs
the experts through the tile-scheduled Triton kernel of `rollout.kernels` instead (decode rows' tiles first).
Every function is free of host synchronisation (no `.item()`, no data-dependent shapes).

Attention reads K/V through the block table (`rollout.paged_attention`: Triton kernels on CUDA, an exact
SDPA reference elsewhere); each token's K/V is written into its cache row before the layer attends, so a
prefill chunk sees its own keys and those cached by earlier steps.

Legend: T flat tokens, S sampled tokens, H hidden, C fused qkv width, N q heads, M kv heads, D head dim,
X flat cache rows, E experts, K top-k, R = T*K routed pairs, F FFN width, V vocab, L MoE layers.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rollout.kernels.persistent_moe import persistent_moe, triton_runs_on
from rollout.kernels.tiling import kernel_num_decode
from rollout.kv_cache import KVCache
from rollout.model_spec import MoeModelSpec
from rollout.paged_attention import AttentionBatch, paged_attention
from rollout.weights import LayerWeights, ModelWeights


@dataclass(frozen=True)
class StepBatch:
    """Device tensors of one engine step: T flat tokens (decode rows first, then prefill chunks)."""

    tokens_T: torch.Tensor  # int64
    positions_T: torch.Tensor  # int64
    cache_rows_T: torch.Tensor  # int64: flat cache row that receives the token's K/V
    attention: AttentionBatch
    sample_S: torch.Tensor  # int64: flat indices of the tokens whose next-token logits are wanted


def rope_tables(
    spec: MoeModelSpec, num_positions: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos [P, D] and sign-folded sin [P, D] of the default RoPE, computed in fp32 as transformers does, then cast
    to the model dtype. sin's first half is negated so that rotate_half(x) sin = cat(x2, x1) signed_sin."""
    d = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = torch.arange(num_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    signed_sin = torch.cat((-sin[:, : d // 2], sin[:, d // 2 :]), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), signed_sin.to(device=device, dtype=dtype)


def apply_rope(x_TND: torch.Tensor, cos_TD: torch.Tensor, signed_sin_TD: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin with rotate_half(x) = (-x2, x1): three kernels (the sign lives in the table)."""
    half = x_TND.shape[-1] // 2
    swapped = torch.cat((x_TND[..., half:], x_TND[..., :half]), dim=-1)
    return torch.addcmul(x_TND * cos_TD[:, None, :], swapped, signed_sin_TD[:, None, :])


class MoeDecoder:
    """The model's forward pass; holds no state besides weights, cache and constant tables."""

    def __init__(
        self, spec: MoeModelSpec, weights: ModelWeights, cache: KVCache, expert_kernel: str = "auto"
    ) -> None:
        self.spec = spec
        self.weights = weights
        self.cache = cache
        device, dtype = weights.embed_VH.device, weights.embed_VH.dtype
        self.cos_PD, self.sin_PD = rope_tables(spec, cache.max_model_len, device, dtype)
        self.sort_dtype = torch.int16 if spec.num_experts <= 2**15 else torch.int32
        self.experts_E = torch.arange(spec.num_experts, device=device, dtype=self.sort_dtype)
        cuda = device.type == "cuda"
        if expert_kernel == "persistent" and not triton_runs_on(device):
            raise ValueError(
                "rollout.expert_kernel=persistent needs a CUDA device (or TRITON_INTERPRET=1 to run the Triton "
                f"interpreter on the CPU); this engine runs on {device}"
            )
        # auto takes the persistent kernel on a GPU: it beat grouped GEMMs and the padded bmm in every measured
        # decode, prefill and mixed pass (bench/RESULTS.md, issue #29); the CPU keeps the grouped GEMMs.
        self.persistent = expert_kernel == "persistent" or (
            expert_kernel == "auto" and cuda and triton_runs_on(device)
        )
        padded = expert_kernel == "padded"
        self.capacity_for = padded_capacity if padded else no_padding
        glue = compiled_or_eager if cuda else (lambda fn: fn)
        self._swiglu, self._padded_rows, self._padded_combine = map(
            glue, (swiglu, padded_rows, padded_combine)
        )

    # ----------------------------------------------------------------------------------------- shared pieces
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.spec.rms_norm_eps)

    def _qkv(
        self, layer: LayerWeights, h_TH: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, N, D] and k, v [T, M, D]; q and k are normalised and rotated together (one set of kernels)."""
        s = self.spec
        qkv_TC = F.linear(h_TH, layer.qkv_CH, layer.qkv_bias_C)
        qk_TXD = qkv_TC[:, : s.q_size + s.kv_size].view(-1, s.num_heads + s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            # transformers rounds the normalised x to the model dtype before the weight multiply: same here.
            weight_XD = torch.cat(
                (layer.q_norm_D.expand(s.num_heads, -1), layer.k_norm_D.expand(s.num_kv_heads, -1))
            )
            qk_TXD = F.rms_norm(qk_TXD, (s.head_dim,), None, s.rms_norm_eps) * weight_XD
        qk_TXD = apply_rope(qk_TXD, cos_TD, sin_TD)
        v_TMD = qkv_TC[:, s.q_size + s.kv_size :].view(-1, s.num_kv_heads, s.head_dim)
        return qk_TXD[:, : s.num_heads], qk_TXD[:, s.num_heads :], v_TMD

    def _out_proj(self, layer: LayerWeights, attn_TQ: torch.Tensor, x_TH: torch.Tensor) -> torch.Tensor:
        if layer.o_bias_H is not None:
            return x_TH + F.linear(attn_TQ, layer.o_HQ, layer.o_bias_H)
        return torch.addmm(x_TH, attn_TQ, layer.o_HQ.t())

    def route(self, layer: LayerWeights, h_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts of each token: softmax(h W_r^T) in fp32, top-k, renormalised when the model says so."""
        logits_TE = F.linear(h_TH, layer.router_EH)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        weights_TK, ids_TK = torch.topk(probs_TE, self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return weights_TK, ids_TK

    def experts(
        self,
        layer: LayerWeights,
        h_TH: torch.Tensor,
        weights_TK: torch.Tensor,
        ids_TK: torch.Tensor,
        residual_TH: torch.Tensor,
        num_decode: int = 0,
    ) -> torch.Tensor:
        """residual + sum_k w_tk down_e(silu(gate_e h_t) * up_e h_t), e = ids_tk; the k-sum runs over the pairs in
        token order (deterministic, unlike index_add). The first `num_decode` tokens are decode rows (the
        persistent kernel tiles a mixed step's tokens all in decode tiles or all in prefill tiles by the size of
        its prefill segment, `kernel_num_decode`, and its decode tiles' height follows their tokens,
        `decode_block_m`)."""
        num_tokens, k = ids_TK.shape
        if self.persistent:
            return persistent_moe(
                h_TH,
                weights_TK,
                ids_TK,
                layer.gate_up_EFH,
                layer.down_EHF,
                residual_TH,
                num_decode=kernel_num_decode(num_tokens, num_decode, k, self.spec.num_experts),
            )
        capacity = self.capacity_for(num_tokens * k, self.spec.num_experts)
        if capacity is not None:
            rows = self._padded_rows(h_TH, ids_TK, self.experts_E, capacity)
            y_PH, y_OH = self._padded_ffn(layer, rows, capacity)
            return self._padded_combine(residual_TH, weights_TK, y_PH, y_OH, rows.slot_R, rows.over_R)
        y_RH = self._sorted_experts(layer, h_TH, ids_TK)
        mix_T1K = weights_TK.to(y_RH.dtype).unsqueeze(1)
        out_T1H = torch.baddbmm(residual_TH.unsqueeze(1), mix_T1K, y_RH.view(num_tokens, k, -1))
        return out_T1H.squeeze(1)

    def _ffn(self, layer: LayerWeights, x_RH: torch.Tensor, ends_E: torch.Tensor) -> torch.Tensor:
        return grouped_ffn(x_RH, layer.gate_up_EFH, layer.down_EHF, ends_E, self._swiglu)

    def _sorted_experts(self, layer: LayerWeights, h_TH: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
        return sorted_experts(h_TH, ids_TK, layer.gate_up_EFH, layer.down_EHF, self.experts_E, self._swiglu)

    def _padded_ffn(
        self, layer: LayerWeights, rows: PaddedRows, capacity: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts for small batches (decode): the first `capacity` pairs of every expert (token order) go
        through two dense bmm over [E, capacity] rows, which read each expert's weights at ~92% of the memory
        bandwidth where grouped GEMMs reach ~65% (bench/rollout_kernels.py); the pairs past an expert's capacity
        go through grouped GEMMs over the overflow only (`padded_rows`). The glue around the GEMMs is compiled
        on a GPU (fused kernels instead of ~30 small ones per layer)."""
        e, c = self.spec.num_experts, capacity
        gate_up_ECF = torch.bmm(rows.x_PH.view(e, c, -1), layer.gate_up_EFH.transpose(1, 2))
        y_PH = torch.bmm(self._swiglu(gate_up_ECF), layer.down_EHF.transpose(1, 2)).view(e * c, -1)
        return y_PH, self._ffn(layer, rows.x_OH, rows.over_ends_E)

    def dense_mlp(self, layer: LayerWeights, h_TH: torch.Tensor, residual_TH: torch.Tensor) -> torch.Tensor:
        """residual + down(silu(gate h) * up h) of a dense (non-MoE) layer."""
        f = self.spec.dense_ffn_size
        gu = F.linear(h_TH, layer.dense_gate_up_FH)
        return torch.addmm(residual_TH, F.silu(gu[:, :f]) * gu[:, f:], layer.dense_down_HF.t())

    def _mlp(
        self, layer: LayerWeights, h_TH: torch.Tensor, residual_TH: torch.Tensor, num_decode: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """residual + MLP(h) and the routed experts (None for a dense layer)."""
        if layer.router_EH is None:
            return self.dense_mlp(layer, h_TH, residual_TH), None
        weights_TK, ids_TK = self.route(layer, h_TH)
        return self.experts(layer, h_TH, weights_TK, ids_TK, residual_TH, num_decode), ids_TK

    def attention_block(
        self, i: int, x_TH: torch.Tensor, step: StepBatch, cos_TD: torch.Tensor, sin_TD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's attention half: x + o(attention(norm(x))) (the step's K/V written at their cache rows
        first, so a prefill chunk sees its own keys), and that sum's post-attention norm (the MLP's input)."""
        s, cache, layer = self.spec, self.cache, self.weights.layers[i]
        k_XMD, v_XMD = cache.layer(i)
        q_TND, k_TMD, v_TMD = self._qkv(layer, self._norm(x_TH, layer.input_norm_H), cos_TD, sin_TD)
        k_XMD.index_copy_(0, step.cache_rows_T, k_TMD)
        v_XMD.index_copy_(0, step.cache_rows_T, v_TMD)
        out_TND = paged_attention(
            q_TND, k_XMD, v_XMD, cache.table_RB, step.attention, cache.block_size, s.head_dim**-0.5
        )
        x_TH = self._out_proj(layer, out_TND.reshape(q_TND.shape[0], s.q_size), x_TH)
        return x_TH, self._norm(x_TH, layer.post_norm_H)

    # ----------------------------------------------------------------------------------------- step
    def embed(self, step: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's embeddings x [T, H] and RoPE tables cos, sin [T, D] at its positions."""
        positions_T = step.positions_T
        return self.weights.embed_VH[step.tokens_T], self.cos_PD[positions_T], self.sin_PD[positions_T]

    def logits(self, x_TH: torch.Tensor, sample_S: torch.Tensor) -> torch.Tensor:
        """Next-token logits [S, V] (model dtype) of the flat tokens sample_S."""
        return F.linear(self._norm(x_TH[sample_S], self.weights.final_norm_H), self.weights.lm_head_VH)

    def forward(self, step: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step's flat tokens through the model, writing their K/V into the cache first in every layer.
        Returns the logits [S, V] (model dtype) at the flat indices `step.sample_S` and the routed experts
        [T, L, K] (int64) of every token. Free of host synchronisation (a captured graph replays it)."""
        x_TH, cos_TD, sin_TD = self.embed(step)
        ids = []
        for i, layer in enumerate(self.weights.layers):
            x_TH, h_TH = self.attention_block(i, x_TH, step, cos_TD, sin_TD)
            x_TH, ids_TK = self._mlp(layer, h_TH, x_TH, step.attention.num_decode)
            if ids_TK is not None:
                ids.append(ids_TK)
        return self.logits(x_TH, step.sample_S), torch.stack(ids, dim=1)


def grouped_ffn(
    x_RH: torch.Tensor, gate_up_EFH: torch.Tensor, down_EHF: torch.Tensor, ends_E: torch.Tensor, act=None
) -> torch.Tensor:
    """Grouped GEMMs over rows grouped by expert (group e ends at ends_E[e]; rows past the last end are not
    computed and hold garbage): down_e act(gate_up_e x); act = swiglu unless a compiled one is given."""
    gate_up_RF = torch._grouped_mm(x_RH, gate_up_EFH.transpose(1, 2), offs=ends_E)
    return torch._grouped_mm((act or swiglu)(gate_up_RF), down_EHF.transpose(1, 2), offs=ends_E)


def sorted_experts(
    h_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    gate_up_EFH: torch.Tensor,
    down_EHF: torch.Tensor,
    experts_E: torch.Tensor,
    act=None,
) -> torch.Tensor:
    """Expert outputs of the pairs in token order, [T*K, H]: a stable sort on the expert ids in experts_E's
    dtype (int16 for <= 32768 experts: a quarter of the radix passes of int64 keys, the same order), grouped
    GEMMs, the rows put back in token order. Pairs with an id past the last expert are not computed (garbage)."""
    k = ids_TK.shape[1]
    sorted_ids_R, order_R = torch.sort(ids_TK.reshape(-1).to(experts_E.dtype), stable=True)
    ends_E = torch.searchsorted(sorted_ids_R, experts_E, right=True, out_int32=True)
    y_RH = grouped_ffn(h_TH[order_R // k], gate_up_EFH, down_EHF, ends_E, act)
    return torch.empty_like(y_RH).index_copy_(0, order_R, y_RH)


def swiglu(gate_up_xF: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [..., 2F] projection."""
    f = gate_up_xF.shape[-1] // 2
    return F.silu(gate_up_xF[..., :f]) * gate_up_xF[..., f:]


class PaddedRows(NamedTuple):
    """Where each routed pair of the padded expert path is computed (R = T*K pairs in token order, P = E*C)."""

    x_PH: torch.Tensor  # expert e's first C pairs' inputs at rows e*C.. (padding rows: token 0's, never read)
    x_OH: torch.Tensor  # [R, H] inputs of the pairs past their expert's C, grouped by expert (then garbage)
    over_ends_E: torch.Tensor  # int32: end of expert e's group in x_OH
    slot_R: torch.Tensor  # row of the pair's output in the dense part, or P if it overflowed
    over_R: torch.Tensor  # row of the pair's output in the overflow part, or R if it fits


def padded_rows(
    h_TH: torch.Tensor, ids_TK: torch.Tensor, experts_E: torch.Tensor, capacity: int
) -> PaddedRows:
    """Rows of the padded expert path, with no sort and no host sync (C = capacity):

    pos(r) = #{r' < r : e(r') = e(r)},  slot(r) = e(r) * C + pos(r)              if pos(r) < C
    over(r) = #{overflow pairs of experts < e(r)} + pos(r) - C                   otherwise
    """
    e, c = experts_E.shape[0], capacity
    ids_R = ids_TK.reshape(-1)
    r, k = ids_R.shape[0], ids_TK.shape[1]
    # Running counts per expert as a scan along the contiguous dim of [E, R]: eager CUDA's scan over the outer dim
    # of [R, E] is ~100x slower.
    seen_ER = torch.cumsum(experts_E[:, None] == ids_R[None, :], dim=1, dtype=torch.int32)
    pos_R = seen_ER.gather(0, ids_R[None, :]).squeeze(0) - 1
    fits_R = pos_R < c
    token_R = torch.arange(r, device=ids_R.device) // k
    slot_R = torch.where(fits_R, ids_R * c + pos_R, e * c)
    over_E = (seen_ER[:, -1] - c).clamp(min=0)
    over_ends_E = torch.cumsum(over_E, dim=0, dtype=torch.int32)
    over_R = torch.where(fits_R, r, (over_ends_E - over_E)[ids_R] + pos_R - c).long()
    # Each part's rows gather their token's hidden state; the other part's pairs write a spare last entry.
    src_P = torch.zeros(e * c + 1, dtype=torch.int64, device=ids_R.device).index_copy(0, slot_R, token_R)
    src_O = torch.zeros(r + 1, dtype=torch.int64, device=ids_R.device).index_copy(0, over_R, token_R)
    return PaddedRows(h_TH[src_P[: e * c]], h_TH[src_O[:r]], over_ends_E, slot_R, over_R)


def padded_combine(
    residual_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    y_PH: torch.Tensor,
    y_OH: torch.Tensor,
    slot_R: torch.Tensor,
    over_R: torch.Tensor,
) -> torch.Tensor:
    """residual + sum_k w_tk y(t, k), y from the dense part where the pair fits, else from the overflow part;
    summed in fp32, rounded once."""
    t, k = weights_TK.shape
    fits_R1 = (slot_R < y_PH.shape[0])[:, None]
    y_RH = torch.where(
        fits_R1, y_PH[slot_R.clamp(max=y_PH.shape[0] - 1)], y_OH[over_R.clamp(max=y_OH.shape[0] - 1)]
    )
    mixed_TH = (weights_TK.float()[..., None] * y_RH.view(t, k, -1).float()).sum(1)
    return (residual_TH.float() + mixed_TH).to(residual_TH.dtype)


def compiled_or_eager(fn):
    """fn compiled by TorchInductor (its small ops fused into a few kernels), or fn itself from the first call on
    which compilation fails (reported once; the eager function gives the same results)."""
    state = {"fn": torch.compile(fn, fullgraph=True)}

    @functools.wraps(fn)
    def call(*args):
        try:
            return state["fn"](*args)
        except Exception as err:
            if state["fn"] is fn:
                raise
            warnings.warn(
                f"torch.compile of {fn.__name__} failed ({type(err).__name__}: {err}); running it eagerly",
                stacklevel=2,
            )
            state["fn"] = fn
            return fn(*args)

    return call


def no_padding(num_pairs: int, num_experts: int) -> None:
    return None


def padded_capacity(num_pairs: int, num_experts: int) -> int | None:
    """Rows per expert of the padded expert path: twice the mean pairs per expert rounded up to a power of two,
    for means of 8-64 pairs (decode at batch 128-1024 for 128 experts top-8); None (grouped GEMMs only) outside,
    where padding would waste compute (large batches) or the rows per expert are too few to pay off."""
    mean = num_pairs / num_experts
    if not 8 <= mean <= 64:
        return None
    return 2 ** (1 + math.ceil(math.log2(mean)))
