"""Forward passes of a Qwen3-MoE / Mixtral decoder over the slot KV cache: prefill (many sequences, flat tokens)
and decode (one token per slot row, fixed shapes so a CUDA graph can capture it).

Numerics follow transformers' modeling code (RMSNorm in fp32, RoPE tables in fp32 cast to the model dtype,
router softmax in fp32, top-k then optional renormalisation), so greedy tokens, log-probs and routing match it.
The experts run as two `torch._grouped_mm` calls over the routed (token, expert) pairs sorted by expert (a stable
sort on int16 expert ids: a quarter of the radix passes of int64 keys, the same order); GPU decode batches with
8-64 pairs per expert instead run dense `torch.bmm` over a fixed number of rows per expert plus grouped GEMMs over
the pairs that do not fit (`padded_rows`, `_padded_ffn`, `padded_capacity`). The weighted sum over the k experts of a token
is one batched matmul (deterministic, unlike an atomic index_add).
Every function is free of host synchronisation (no `.item()`, no data-dependent shapes) in the decode path.

Decode attention: on CUDA (half precision) FlashAttention-2's variable-length kernel reads each slot's keys in
place from the cache (cumulative key offsets slot * max_model_len, `seqused_k` = position + 1 keys per row, GQA
without copying K/V); elsewhere one SDPA call with an additive mask over `[B, M, S, D]` cache views. The flash
path is only taken after a probe on the device matched SDPA (`flash_decode_works`). Measured on the H200
(bench/rollout_kernels.py, 256 rows, 192-key bucket): 63 us per layer, the same as masked SDPA (61 us); it is
kept because it reads only each row's own keys (no padding to the key bucket) and needs no mask.

Legend: T flat tokens, B decode rows (= cache slots), X = B*G folded query rows, H hidden, C fused qkv width, N q heads, M kv heads,
G q heads per kv head, D head dim, S attended positions, E experts, K top-k, R = T*K routed pairs,
F FFN width, V vocab, L MoE layers.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rollout.kv_cache import KVCache
from rollout.model_spec import MoeModelSpec
from rollout.weights import LayerWeights, ModelWeights


@dataclass(frozen=True)
class _AttentionGroup:
    """Fresh prefill pieces attended together: their tokens gathered into a padded [n, Lmax] batch."""

    gather_nl: torch.Tensor  # flat token index of each (piece, position); padding repeats a valid index
    valid_nl: torch.Tensor  # bool: real (not padding) positions
    scatter_t: torch.Tensor  # flat token index of each valid position, in valid_nl's row-major order
    mask_n1ll: torch.Tensor | None  # causal & key < length; None when every piece has the same length


@dataclass(frozen=True)
class PrefillPiece:
    """A run of `length` prompt tokens of one sequence, at positions [start, start + length) of cache `slot`."""

    slot: int
    start: int
    length: int


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
    """The model's forward passes; holds no state besides weights, cache and constant tables."""

    def __init__(self, spec: MoeModelSpec, weights: ModelWeights, cache: KVCache) -> None:
        self.spec = spec
        self.weights = weights
        self.cache = cache
        device, dtype = weights.embed_VH.device, weights.embed_VH.dtype
        self.cos_PD, self.sin_PD = rope_tables(spec, cache.max_model_len, device, dtype)
        self.sort_dtype = torch.int16 if spec.num_experts <= 2**15 else torch.int32
        self.experts_E = torch.arange(spec.num_experts, device=device, dtype=self.sort_dtype)
        self.positions_P = torch.arange(cache.max_model_len, device=device)
        self.rows_S = torch.arange(cache.num_slots, device=device)
        # Flash varlen decode: row b holds G query rows (its q heads of one kv head each, see
        # _flash_decode_attention); slot b's keys start at b * max_model_len of the flat cache.
        rows_S1 = torch.arange(cache.num_slots + 1, device=device, dtype=torch.int32)
        self.query_starts_S1 = rows_S1 * (spec.num_heads // spec.num_kv_heads)
        self.key_starts_S1 = rows_S1 * cache.max_model_len
        self.flash_decode = False
        # Decode batches use the padded expert path on a GPU (see _padded_ffn); tests may set another rule.
        cuda = device.type == "cuda"
        self.capacity_for = padded_capacity if cuda else no_padding
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
    ) -> torch.Tensor:
        """residual + sum_k w_tk down_e(silu(gate_e h_t) * up_e h_t), e = ids_tk; the k-sum runs over the pairs in
        token order (deterministic, unlike index_add)."""
        num_tokens, k = ids_TK.shape
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
        """Grouped GEMMs over rows grouped by expert (group e ends at ends_E[e]; rows past the last end are
        not computed and hold garbage)."""
        gate_up_RF = torch._grouped_mm(x_RH, layer.gate_up_EFH.transpose(1, 2), offs=ends_E)
        return torch._grouped_mm(self._swiglu(gate_up_RF), layer.down_EHF.transpose(1, 2), offs=ends_E)

    def _sorted_experts(self, layer: LayerWeights, h_TH: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
        """Expert outputs of the pairs in token order, [T*K, H]: a stable sort on int16 expert ids (a quarter of
        the radix passes of int64 keys, the same order), grouped GEMMs, the rows put back in token order."""
        k = ids_TK.shape[1]
        sorted_ids_R, order_R = torch.sort(ids_TK.reshape(-1).to(self.sort_dtype), stable=True)
        ends_E = torch.searchsorted(sorted_ids_R, self.experts_E, right=True, out_int32=True)
        y_RH = self._ffn(layer, h_TH[order_R // k], ends_E)
        return torch.empty_like(y_RH).index_copy_(0, order_R, y_RH)

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

    def _mlp(
        self, layer: LayerWeights, h_TH: torch.Tensor, residual_TH: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """residual + MLP(h) and the routed experts (None for a dense layer)."""
        if layer.router_EH is None:
            f = self.spec.dense_ffn_size
            gu = F.linear(h_TH, layer.dense_gate_up_FH)
            return torch.addmm(residual_TH, F.silu(gu[:, :f]) * gu[:, f:], layer.dense_down_HF.t()), None
        weights_TK, ids_TK = self.route(layer, h_TH)
        return self.experts(layer, h_TH, weights_TK, ids_TK, residual_TH), ids_TK

    def logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        return F.linear(self._norm(x_TH, self.weights.final_norm_H), self.weights.lm_head_VH).float()

    def _layer(
        self,
        i: int,
        layer: LayerWeights,
        x_TH: torch.Tensor,
        cos_TD: torch.Tensor,
        sin_TD: torch.Tensor,
        cache_rows_T: torch.Tensor,
        attend,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decoder layer: attention (K/V written at cache rows first, then `attend(q, k, v)`) and the MLP."""
        q_TND, k_TMD, v_TMD = self._qkv(layer, self._norm(x_TH, layer.input_norm_H), cos_TD, sin_TD)
        k_flat, v_flat = self.cache.flat(i)
        k_flat.index_copy_(0, cache_rows_T, k_TMD)
        v_flat.index_copy_(0, cache_rows_T, v_TMD)
        x_TH = self._out_proj(layer, attend(q_TND, k_TMD, v_TMD), x_TH)
        return self._mlp(layer, self._norm(x_TH, layer.post_norm_H), x_TH)

    # ----------------------------------------------------------------------------------------- decode
    def decode(
        self,
        tokens_B: torch.Tensor,
        positions_B: torch.Tensor,
        num_keys: int,
        routes_BLK: torch.Tensor,
        logits_BV: torch.Tensor,
    ) -> None:
        """One token per row b (row = cache slot) at position positions_B[b]; attends to positions <= it among
        the first `num_keys` of its slot. Writes the experts used into routes_BLK and the logits (model dtype)
        into logits_BV: static buffers, so a captured graph allocates no output."""
        s, cache = self.spec, self.cache
        b, x_dtype = tokens_B.shape[0], self.weights.embed_VH.dtype
        cache_rows_B = self.rows_S[:b] * cache.max_model_len + positions_B
        cos_BD, sin_BD = self.cos_PD[positions_B], self.sin_PD[positions_B]
        groups = s.num_heads // s.num_kv_heads
        num_keys_B = mask_B11S = None
        if self.flash_decode:
            num_keys_B = (positions_B + 1).to(torch.int32)
        else:
            # An additive mask built once per step (a boolean one is converted again in every layer's SDPA call).
            hidden_BS = self.positions_P[:num_keys][None, :] > positions_B[:, None]
            mask_B11S = torch.zeros(b, 1, 1, num_keys, dtype=x_dtype, device=tokens_B.device).masked_fill_(
                hidden_BS.view(b, 1, 1, num_keys), float("-inf")
            )
        x_BH = self.weights.embed_VH[tokens_B]
        ids = []
        for i, layer in enumerate(self.weights.layers):

            def attend(q_BND, _k, _v, i=i):
                if num_keys_B is not None:
                    return self._flash_decode_attention(i, q_BND, num_keys_B, num_keys)
                # GQA without copying K/V: the G query heads of a kv head become G query rows of that head.
                k_BMSD, v_BMSD = cache.keys_values(i, b, num_keys)
                out_BMGD = F.scaled_dot_product_attention(
                    q_BND.view(b, s.num_kv_heads, groups, s.head_dim),
                    k_BMSD,
                    v_BMSD,
                    attn_mask=mask_B11S,
                    scale=s.head_dim**-0.5,
                )
                return out_BMGD.reshape(b, s.q_size)

            x_BH, ids_BK = self._layer(i, layer, x_BH, cos_BD, sin_BD, cache_rows_B, attend)
            if ids_BK is not None:
                ids.append(ids_BK)
        routes_BLK.copy_(torch.stack(ids, dim=1))
        torch.mm(self._norm(x_BH, self.weights.final_norm_H), self.weights.lm_head_VH.t(), out=logits_BV)

    def _flash_decode_attention(
        self, layer_index: int, q_BND: torch.Tensor, num_keys_B: torch.Tensor, max_keys: int
    ) -> torch.Tensor:
        """softmax(q K^T / sqrt(D)) V of row b over the first num_keys_B[b] positions of slot b, as [B, N * D].

        GQA folded into the query length: the G q heads of kv head m become G query rows of a sequence with M
        heads (no causal mask: they all sit at the same position), so each (row, kv head) block of the cache is
        read by one thread block, not by G of them."""
        s = self.spec
        b, groups = q_BND.shape[0], s.num_heads // s.num_kv_heads
        q_XMD = (
            q_BND.view(b, s.num_kv_heads, groups, s.head_dim)
            .transpose(1, 2)
            .reshape(-1, s.num_kv_heads, s.head_dim)
        )
        k_flat, v_flat = self.cache.flat(layer_index)
        out_XMD = torch.ops.aten._flash_attention_forward(
            q_XMD,
            k_flat,
            v_flat,
            self.query_starts_S1[: b + 1],
            self.key_starts_S1[: b + 1],
            groups,
            max_keys,
            0.0,
            False,
            False,
            scale=s.head_dim**-0.5,
            seqused_k=num_keys_B,
        )[0]
        return out_XMD.view(b, groups, s.num_kv_heads, s.head_dim).transpose(1, 2).reshape(b, s.q_size)

    # ----------------------------------------------------------------------------------------- prefill
    def prefill(
        self, tokens_T: torch.Tensor, pieces: list[PrefillPiece], last_index: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the flat tokens of `pieces` (concatenated in order) through the model, writing their K/V into the
        cache. Returns fp32 logits [len(last_index), V] at the flat indices `last_index` and the routed experts
        [T, L, K] (int64) of every token."""
        cache = self.cache
        device = tokens_T.device
        slots_T = torch.cat([torch.full((p.length,), p.slot, dtype=torch.long) for p in pieces])
        positions_T = torch.cat([torch.arange(p.start, p.start + p.length) for p in pieces])
        cache_rows_T = (slots_T * cache.max_model_len + positions_T).to(device)
        positions_T = positions_T.to(device)
        cos_TD, sin_TD = self.cos_PD[positions_T], self.sin_PD[positions_T]
        groups, continued = self._attention_plan(pieces, device)
        x_TH = self.weights.embed_VH[tokens_T]
        ids = []
        for i, layer in enumerate(self.weights.layers):

            def attend(q, k, v, i=i):
                return self._prefill_attention(i, groups, continued, q, k, v)

            x_TH, ids_TK = self._layer(i, layer, x_TH, cos_TD, sin_TD, cache_rows_T, attend)
            if ids_TK is not None:
                ids.append(ids_TK)
        last_R = torch.tensor(last_index, dtype=torch.long, device=device)
        return self.logits(x_TH[last_R]), torch.stack(ids, dim=1)

    def _attention_plan(
        self, pieces: list[PrefillPiece], device: torch.device
    ) -> tuple[list[_AttentionGroup], list[tuple[PrefillPiece, int]]]:
        """Fresh pieces (start 0) grouped by length (padding at most doubles a group's tokens) for batched
        attention; continued pieces (chunked prefill) are attended one by one over their cached prefix."""
        offsets, offset = [], 0
        for p in pieces:
            offsets.append(offset)
            offset += p.length
        fresh = sorted((p.length, off) for p, off in zip(pieces, offsets) if p.start == 0)[::-1]
        continued = [(p, off) for p, off in zip(pieces, offsets) if p.start > 0]
        groups, current = [], []
        for length, off in fresh:
            if current and (len(current) + 1) * current[0][0] > 2 * (sum(n for n, _ in current) + length):
                groups.append(self._group(current, device))
                current = []
            current.append((length, off))
        if current:
            groups.append(self._group(current, device))
        return groups, continued

    def _group(self, members: list[tuple[int, int]], device: torch.device) -> _AttentionGroup:
        longest = members[0][0]
        pos_L = torch.arange(longest)
        lengths_n = torch.tensor([n for n, _ in members])
        valid_nl = pos_L[None, :] < lengths_n[:, None]
        starts_n = torch.tensor([off for _, off in members])
        gather_nl = starts_n[:, None] + torch.minimum(pos_L[None, :], lengths_n[:, None] - 1)
        mask = None
        if bool((lengths_n != longest).any()):
            causal_ll = pos_L[None, :] <= pos_L[:, None]
            mask = (causal_ll[None] & valid_nl[:, None, :]).unsqueeze(1).to(device)
        return _AttentionGroup(
            gather_nl.to(device), valid_nl.to(device), gather_nl[valid_nl].to(device), mask
        )

    def _prefill_attention(
        self,
        layer_index: int,
        groups: list[_AttentionGroup],
        continued: list[tuple[PrefillPiece, int]],
        q_TND: torch.Tensor,
        k_TMD: torch.Tensor,
        v_TMD: torch.Tensor,
    ) -> torch.Tensor:
        """Causal attention of every piece over its sequence so far, as [T, N * D]."""
        s = self.spec
        reps = s.num_heads // s.num_kv_heads
        out_TND = torch.empty_like(q_TND, memory_format=torch.contiguous_format)
        for g in groups:
            # K/V expanded to all query heads so SDPA can use its fused kernels (no GQA support with masks).
            q_nNLD = q_TND[g.gather_nl].transpose(1, 2)
            k_nNLD = k_TMD[g.gather_nl].repeat_interleave(reps, dim=2).transpose(1, 2)
            v_nNLD = v_TMD[g.gather_nl].repeat_interleave(reps, dim=2).transpose(1, 2)
            o_nNLD = F.scaled_dot_product_attention(
                q_nNLD,
                k_nNLD,
                v_nNLD,
                attn_mask=g.mask_n1ll,
                is_causal=g.mask_n1ll is None,
                scale=s.head_dim**-0.5,
            )
            out_TND[g.scatter_t] = o_nNLD.transpose(1, 2)[g.valid_nl]
        for p, off in continued:
            end = p.start + p.length
            k_MSD = self.cache.k_LSPND[layer_index, p.slot, :end].transpose(0, 1)
            v_MSD = self.cache.v_LSPND[layer_index, p.slot, :end].transpose(0, 1)
            q_pos = torch.arange(p.start, end, device=q_TND.device)
            mask_QS = self.positions_P[:end][None, :] <= q_pos[:, None]
            o_1NQD = F.scaled_dot_product_attention(
                q_TND[off : off + p.length].transpose(0, 1).unsqueeze(0),
                k_MSD.repeat_interleave(reps, dim=0).unsqueeze(0),
                v_MSD.repeat_interleave(reps, dim=0).unsqueeze(0),
                attn_mask=mask_QS,
                scale=s.head_dim**-0.5,
            )
            out_TND[off : off + p.length] = o_1NQD[0].transpose(0, 1)
        return out_TND.view(q_TND.shape[0], s.q_size)


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


def flash_decode_works(model: MoeDecoder) -> bool:
    """Whether the flash varlen decode attention runs on this device and build and agrees with the SDPA path:
    one decode-shaped call (4 rows, ragged lengths, the cache's real layout) compared with masked SDPA."""
    cache, s = model.cache, model.spec
    if cache.k_LSPND.device.type != "cuda" or cache.k_LSPND.dtype not in (torch.bfloat16, torch.float16):
        return False
    device, dtype = cache.k_LSPND.device, cache.k_LSPND.dtype
    rows = min(4, cache.num_slots)
    lengths = [min(cache.max_model_len, n) for n in (1, 7, 33, 70)][:rows]
    gen = torch.Generator(device=device).manual_seed(0)
    saved = cache.k_LSPND[0, :rows].clone(), cache.v_LSPND[0, :rows].clone()
    try:
        for t in (cache.k_LSPND, cache.v_LSPND):
            t[0, :rows].copy_(torch.randn(t[0, :rows].shape, generator=gen, device=device, dtype=dtype))
        q_BXD = torch.randn(rows, s.num_heads + s.num_kv_heads, s.head_dim, generator=gen, device=device)
        q_BND = q_BXD.to(dtype)[:, : s.num_heads]  # a strided view, like the q of the fused qkv projection
        num_keys_B = torch.tensor(lengths, dtype=torch.int32, device=device)
        out = model._flash_decode_attention(0, q_BND, num_keys_B, max(lengths)).float()
        ref = []
        for r, n in enumerate(lengths):
            k_NSD, v_NSD = (x[0, r, :n].transpose(0, 1).float() for x in (cache.k_LSPND, cache.v_LSPND))
            reps = s.num_heads // s.num_kv_heads
            ref.append(
                F.scaled_dot_product_attention(
                    q_BND[r].float()[:, None, :],
                    k_NSD.repeat_interleave(reps, 0),
                    v_NSD.repeat_interleave(reps, 0),
                    scale=s.head_dim**-0.5,
                ).reshape(-1)
            )
        return bool((out - torch.stack(ref)).abs().max() < 2e-2)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    finally:
        cache.k_LSPND[0, :rows].copy_(saved[0])
        cache.v_LSPND[0, :rows].copy_(saved[1])
