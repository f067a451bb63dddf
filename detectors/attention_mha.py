"""torch.nn.MultiheadAttention, measured in a forward hook that reprojects
the sampled query rows and the keys with the module's own in-projection."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mmtrace.detectors.attention_rows import KeyRule, torch_nn_mask
from mmtrace.detectors.entropy_math import Measurement, row_scores


def measure_mha(name, mha: nn.MultiheadAttention, args, kwargs, rows_for) -> Measurement:
    """The logits of the sampled rows of one call of `mha`, from the
    arguments its forward hook saw; `rows_for` is the forward's
    RowSampler.rows_for."""
    bound = dict(zip(("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask"), args))
    bound.update(kwargs)
    query, key = bound["query"].detach(), bound["key"].detach()
    self_attention = bound["query"] is bound["key"]
    if query.dim() == 2:  # unbatched (L, E)
        query, key = query.unsqueeze(0), key.unsqueeze(0)
    elif not mha.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    batch, q_len, embed = query.shape
    kv_len = key.shape[1]
    heads, dim = mha.num_heads, mha.head_dim

    rule = KeyRule(self_attention=self_attention)
    sources = []
    attn_mask = bound.get("attn_mask")
    if attn_mask is not None:
        sources.append(attn_mask)
        if attn_mask.dim() == 3:  # (batch * heads, L, S)
            attn_mask = attn_mask.reshape(batch, heads, q_len, kv_len)
        else:  # (L, S), shared by the batch
            attn_mask = attn_mask.reshape(1, 1, q_len, kv_len)
        rule.masks.append(torch_nn_mask(attn_mask))
    padding = bound.get("key_padding_mask")
    if padding is not None:
        sources.append(padding)
        rule.masks.append(torch_nn_mask(padding.reshape(batch, kv_len)))
    rule.extra_keys = int(mha.bias_k is not None) + int(mha.add_zero_attn)
    rows = rows_for(rule, tuple(sources), batch, q_len, kv_len, query.device)

    if mha._qkv_same_embed_dim:
        w_q, w_k = mha.in_proj_weight[:embed], mha.in_proj_weight[embed : 2 * embed]
    else:
        w_q, w_k = mha.q_proj_weight, mha.k_proj_weight
    b_q = b_k = None
    if mha.in_proj_bias is not None:
        b_q, b_k = mha.in_proj_bias[:embed], mha.in_proj_bias[embed : 2 * embed]
    q_rows = F.linear(query[rows.b, rows.i], w_q, b_q).reshape(-1, heads, dim)
    # Each batch element's keys are projected once; the rows index them.
    keys = F.linear(key, w_k, b_k)
    if mha.bias_k is not None:
        keys = torch.cat([keys, mha.bias_k.reshape(1, 1, embed).expand(batch, 1, embed)], dim=1)
    keys = keys.reshape(batch, -1, heads, dim).transpose(1, 2)
    if mha.add_zero_attn:
        keys = F.pad(keys, (0, 0, 0, 1))
    return Measurement(name, rows, row_scores(q_rows, keys, rows, dim**-0.5))
