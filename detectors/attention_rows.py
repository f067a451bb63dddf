"""Which query rows of an attention call are measured, and which keys each
of them may attend to.

Every attention call states its masking its own way (a boolean or additive
mask in one of several conventions, a causal flag, a sliding window, extra
keys); a KeyRule gathers them, so that the sampled rows get the same
visible keys, bias and normaliser as the attention kernel used.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F


class Unsupported(Exception):
    """An attention call whose masking this module cannot reproduce."""


# How a mask tensor says "visible".
_ATTEND_IS_TRUE = "bool: True = attend"  # transformers
_MASKED_IS_TRUE = "bool: True = masked"  # torch.nn
_ADDITIVE = "float: added to the scores; -inf / dtype minimum = masked"
_NONZERO_KEEPS = "int: nonzero = attend"  # flash-style padding masks
BIAS_ONLY = "float: added to the scores, masks nothing"


@dataclass
class KeyRule:
    """How one attention call masks keys.

    masks: (tensor, convention) pairs, each broadcastable to (batch, heads,
        q_len, kv_len) once made 4-d.
    causal: key j visible from query i only if j <= i + offset.
    window: and only if j > i + offset - window.
    extra_keys: keys appended after the masked ones that every row sees
        (nn.MultiheadAttention's bias_k / zero attention).
    self_attention: query i is the token of key i, so a row whose own key is
        masked (padding) is not worth measuring.
    """

    masks: list[tuple[torch.Tensor, str]] = field(default_factory=list)
    causal: bool = False
    offset: int = 0
    window: int | None = None
    extra_keys: int = 0
    self_attention: bool = False

    def cache_key(self, sources: tuple, batch: int, q_len: int, kv_len: int) -> tuple:
        """Identity of this masking within one forward; `sources` are the
        tensors the masks were made from."""
        ids = tuple(id(source) for source in sources)
        flags = (self.causal, self.offset, self.window, self.extra_keys, self.self_attention)
        return ids, flags, batch, q_len, kv_len

    def sample(self, pick_rows, batch: int, q_len: int, kv_len: int, device) -> SampledRows:
        """Choose query rows with `pick_rows((batch, q_len) bool measurable)`
        and work out their visible keys, bias and normaliser."""
        terms = [_as_term(mask, convention) for mask, convention in self.masks]
        structural = self._structural(torch.arange(q_len, device=device), kv_len)  # (L, S) or None
        flat, keep = pick_rows(self._measurable(terms, structural, batch, q_len, kv_len, device))
        b, i = flat // q_len, flat % q_len
        if structural is None and not any(valid is not None for valid, _ in terms):
            visible = None
        else:
            visible = self._structural(i, kv_len)
            visible = None if visible is None else visible.unsqueeze(1)
        bias = None
        for valid, term_bias in terms:
            if valid is not None:
                rows_valid = _rows_of(valid, b, i)
                visible = rows_valid if visible is None else visible & rows_valid
            if term_bias is not None:
                rows_bias = _rows_of(term_bias, b, i).float()
                bias = rows_bias if bias is None else bias + rows_bias
        if self.extra_keys:
            if visible is not None:
                visible = F.pad(visible, (0, self.extra_keys), value=True)
            if bias is not None:
                bias = F.pad(bias, (0, self.extra_keys), value=0.0)
        if visible is None:
            return SampledRows(b, i, flat, keep, None, bias, math.log(kv_len + self.extra_keys))
        log_visible = visible.sum(-1).clamp(min=2).float().log()
        return SampledRows(b, i, flat, keep, ~visible, bias, log_visible)

    def _measurable(self, terms, structural, batch, q_len, kv_len, device) -> torch.Tensor:
        """(batch, q_len) bool: rows with at least two visible keys (and, for
        self-attention, a visible own key)."""
        visible = structural
        for valid, _ in terms:
            if valid is not None:
                visible = valid if visible is None else visible & valid
        if visible is None:
            enough = kv_len + self.extra_keys >= 2
            return torch.full((batch, q_len), enough, dtype=torch.bool, device=device)
        if visible.dim() == 2:
            visible = visible[None, None]
        visible = visible.expand(-1, -1, q_len, kv_len)
        ok = (visible.sum(-1) + self.extra_keys >= 2).all(dim=1)
        if self.self_attention and q_len == kv_len:
            ok = ok & visible.diagonal(0, -2, -1).all(dim=1)
        return ok.expand(batch, q_len)

    def _structural(self, i: torch.Tensor, kv_len: int) -> torch.Tensor | None:
        """(len(i), kv_len) bool from the causal diagonal and window, or None."""
        if not self.causal and self.window is None:
            return None
        j = torch.arange(kv_len, device=i.device)
        last = i.unsqueeze(-1) + self.offset
        visible = j <= last if self.causal else torch.ones_like(last, dtype=torch.bool)
        if self.window is not None:
            visible = visible & (j > last - self.window)
        return visible


@dataclass
class SampledRows:
    b: torch.Tensor  # (K,) batch index of each sampled row
    i: torch.Tensor  # (K,) query position
    flat: torch.Tensor  # (K,) b * q_len + i
    keep: torch.Tensor  # (K,) False for filler picks when fewer rows qualified
    hidden: torch.Tensor | None  # (K, 1 or H, S) True where a key is masked; None: none is
    bias: torch.Tensor | None  # (K, 1 or H, S) added to the scores
    log_visible: torch.Tensor | float  # log(number of visible keys), (K, 1 or H)


def _rows_of(t: torch.Tensor, b: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """Index a (B or 1, H or 1, L or 1, S) tensor at rows (b, i) -> (K, H or 1, S)."""
    b = b if t.shape[0] > 1 else torch.zeros_like(b)
    i = i if t.shape[2] > 1 else torch.zeros_like(i)
    return t[b, :, i, :]


def _as_term(mask: torch.Tensor, convention: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(visible bool or None, additive bias or None), both 4-d."""
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)
    elif mask.dim() == 2:
        mask = mask[:, None, None, :]
    elif mask.dim() != 4:
        raise Unsupported(f"mask shape {tuple(mask.shape)} (expected 2-, 3- or 4-d)")
    if convention == BIAS_ONLY:
        return None, mask
    if mask.dtype == torch.bool:
        return (mask if convention == _ATTEND_IS_TRUE else ~mask), None
    if mask.is_floating_point():
        # Masked entries are -inf or the dtype's most negative value; any
        # other value is a bias that takes part in the softmax.
        return mask > torch.finfo(mask.dtype).min / 2, mask
    return mask != 0, None


def hf_mask(mask) -> tuple[torch.Tensor, str]:
    if not isinstance(mask, torch.Tensor):
        raise Unsupported(f"attention mask of type {type(mask).__name__} (expected a tensor or None)")
    if mask.dtype == torch.bool:
        return mask, _ATTEND_IS_TRUE
    return mask, _ADDITIVE if mask.is_floating_point() else _NONZERO_KEEPS


def torch_nn_mask(mask: torch.Tensor) -> tuple[torch.Tensor, str]:
    return mask, _MASKED_IS_TRUE if mask.dtype == torch.bool else _ADDITIVE


class RowSampler:
    """Chooses the measured query rows, from a private generator so that
    the global RNG (dropout) is untouched; `rows=None` takes every
    measurable row."""

    def __init__(self, rows: int | None, seed: int) -> None:
        self.rows = rows
        self._generator = torch.Generator().manual_seed(seed)
        self._generator_lock = threading.Lock()

    def rows_for(self, cache: dict, rule: KeyRule, sources: tuple, batch: int, q_len: int, kv_len: int, device):
        """The forward's sampled rows for this masking. Layers that share a
        mask share the rows, so sampling and mask work happen once per
        forward; `cache` (one per forward) holds `sources` (the mask tensors
        as passed) so that their ids stay unique while it lives."""
        key = rule.cache_key(sources, batch, q_len, kv_len)
        cached = cache.get(key)
        if cached is None:
            cached = (sources, rule.sample(self._pick, batch, q_len, kv_len, device))
            cache[key] = cached
        return cached[1]

    def _pick(self, measurable: torch.Tensor):
        """Choose rows among the measurable (B, L) ones: (flat index b * L + i, keep)."""
        flat = measurable.reshape(-1)
        if self.rows is None:
            index = flat.nonzero().squeeze(1)
            keep = torch.ones_like(index, dtype=torch.bool)
        else:
            # Random keys, unmeasurable rows pushed below zero, top-k: a
            # uniform choice among measurable rows without a device sync.
            with self._generator_lock:
                keys = torch.rand(flat.shape[0], generator=self._generator)
            keys = torch.where(flat, keys.to(flat.device), -1.0)
            picked, index = keys.topk(min(self.rows, flat.shape[0]))
            keep = picked >= 0
        return index, keep
