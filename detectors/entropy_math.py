"""Normalised attention entropy of sampled query rows.

The logits of the sampled rows are computed where the attention call
happens (one small matmul against the keys); their softmax and entropy are
taken for all layers of a forward together, with one device-to-host copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmtrace.detectors.attention_rows import SampledRows, Unsupported


@dataclass
class Measurement:
    layer: str
    rows: SampledRows
    scores: torch.Tensor  # (K, H, S) logits; the entropy is taken once per forward for all layers


def row_scores(
    q_rows: torch.Tensor, keys: torch.Tensor, rows: SampledRows, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """Attention logits of the sampled rows, q_rows (K, H, d) against keys
    (B, H_kv, S, d), before masking: (K, H, S) float32."""
    n_rows, heads, dim = q_rows.shape
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    if heads % kv_heads:
        raise Unsupported(f"{heads} query heads over {kv_heads} key heads (expected a multiple)")
    group = heads // kv_heads  # grouped-query attention: head h reads key head h // group
    q = q_rows.float() * scale
    if keys.shape[0] == 1:
        # One batch element: multiply against its keys where they lie rather
        # than gather a copy per row (long KV caches).
        q = q.reshape(n_rows, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, n_rows * group, dim)
        scores = torch.matmul(q, keys[0].float().transpose(-1, -2))  # (H_kv, K * group, S)
        scores = scores.reshape(kv_heads, n_rows, group, kv_len).transpose(0, 1).reshape(n_rows, heads, kv_len)
    else:
        q = q.reshape(n_rows, kv_heads, group, dim)
        scores = torch.matmul(q, keys.index_select(0, rows.b).float().transpose(-1, -2))
        scores = scores.reshape(n_rows, heads, kv_len)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if rows.bias is not None:
        scores = scores + rows.bias
    return scores


def normalised_entropy(scores: torch.Tensor, rows: SampledRows) -> torch.Tensor:
    """Entropy / log(visible keys) of logits (..., K, H, S) -> (..., K, H).
    Leading dimensions batch several layers into one pass."""
    if rows.hidden is not None:
        scores = scores.masked_fill(rows.hidden, float("-inf"))
    entropy = torch.special.entr(torch.softmax(scores, dim=-1)).sum(-1)
    return entropy / rows.log_visible


def query_rows(query: torch.Tensor, rows: SampledRows) -> torch.Tensor:
    """query (B, H, L, d) at the sampled rows -> (K, H, d)."""
    by_token = query.transpose(1, 2)  # (B, L, H, d)
    if by_token.is_contiguous():  # the usual view of a projection output: no copy
        return by_token.flatten(0, 1).index_select(0, rows.flat)
    return query[rows.b, :, rows.i, :]


def reduce_measurements(pending: list[Measurement]) -> list[tuple[str, list, list, list]]:
    """Entropy of held logits, one pass per group of layers that share
    sampled rows and shape. Returns, in layer order, (layer, kept rows
    [[b, i], ...], per-head lists of per-row values, per-head means)."""
    groups: dict[tuple, list[int]] = {}
    for position, m in enumerate(pending):
        groups.setdefault((id(m.rows), tuple(m.scores.shape)), []).append(position)
    out: list = [None] * len(pending)
    with torch.no_grad():
        for positions in groups.values():
            rows = pending[positions[0]].rows
            entropy = normalised_entropy(torch.stack([pending[p].scores for p in positions]), rows)
            # Filler picks and rows that came out NaN (fully masked) are
            # dropped; rounding can overshoot [0, 1] by an ulp.
            kept = rows.keep & torch.isfinite(entropy).all(dim=0).all(dim=-1)
            entropy = entropy[:, kept].clamp_(0.0, 1.0)
            per_head = entropy.transpose(1, 2).tolist()  # (layers, H, K): one device-to-host copy
            means = entropy.mean(dim=1).tolist()
            where = torch.stack([rows.b[kept], rows.i[kept]], dim=1).tolist()
            for p, head_rows, head_means in zip(positions, per_head, means):
                out[p] = (pending[p].layer, where, head_rows, head_means)
    return out
