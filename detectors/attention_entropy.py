"""Attention entropy measured inside a running model.

`watch(model, ...)` hooks every attention module it recognises and, on every
N-th forward of `model`, reports the normalised entropy of K sampled query
rows per (layer, head):

    H(row) = -sum_j p_j log p_j / log(number of keys the row may attend to)

so a uniform row scores 1.0 and a row that attends to one key scores 0.0.

Fused attention (SDPA, flash) never materialises the weights, so they are
recomputed, for the sampled rows only, as softmax(q k^T * scale + mask) from
the very query and key tensors the module hands to its attention kernel:

- transformers attention modules all obtain their kernel through
  `AttentionInterface.get_interface(...)`. While a watched forward runs, that
  lookup returns the kernel wrapped in a function that calls it unchanged and
  then measures its (query, key, mask, scaling) arguments. Those are the
  tensors after the module's own projections, norms, rotary embedding and
  KV cache, so no architecture has to be re-implemented here. Grouped-query
  heads, causal / padding / sliding-window masks, additive position bias and
  logit soft-capping are honoured.
- `torch.nn.MultiheadAttention` is measured in a forward hook that reprojects
  the sampled query rows and the keys with the module's own in-projection.

The model's outputs are unchanged: the hooks only read, the measurement runs
under `torch.no_grad` on detached tensors, and row sampling draws from a
private generator, so the global RNG (dropout) is untouched.

Cost: outside sampled forwards a hook does a counter increment and returns.
On a sampled forward each attention call adds a gather of the sampled query
rows and one small matmul against the keys (rows x heads x keys x head_dim);
the softmax and entropy of all layers run together when the forward ends,
with one device-to-host copy. `bench/bench_attention_hooks.py` measures it.

Not measured, and reported (counter `unmeasured` plus one RuntimeWarning per
module): attention modules that do not go through transformers' attention
interface, and flex-attention block masks. Attention sinks (learned logits
outside the keys, gpt-oss) are left out of the softmax. Hooks inside
`torch.nn.TransformerEncoderLayer` make torch skip that layer's fused fast
path (a RuntimeWarning says so), which can change its outputs in the last
bits; every other model runs exactly as unwatched.
"""

from __future__ import annotations

import inspect
import itertools
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["AttentionWatch", "watch"]


# Child names that hold query/key projections in transformers attention
# modules (separate, or fused into one matrix).
_QK_CHILD_NAMES = frozenset(
    {"q_proj", "k_proj", "query", "key", "q", "k", "qkv", "qkv_proj", "c_attn", "Wqkv", "query_key_value", "in_proj"}
)
_INTERFACE_ARGUMENTS = ("module", "query", "key", "value", "attention_mask")


def watch(
    model: nn.Module,
    *,
    every: int = 10,
    rows: int | None = 8,
    sink: Callable[[list[dict]], object],
    modality: str | None = None,
    seed: int = 0,
) -> AttentionWatch:
    """Hook every attention module of `model` and report attention entropy.

    every: measure the N-th, 2N-th, ... forward of `model` (counted at the
        top-level module; nested calls of `model` count once). The default,
        10, keeps the cost within a few percent of a one-sentence forward
        (BENCHMARKS.md); use 1 to measure every forward.
    rows: query rows sampled per forward, uniformly among the rows that
        attend to at least two keys (padding rows excluded); every head, and
        every layer that sees the same mask, uses the same rows. None
        measures every such row.
    sink: called once per measured forward that yielded samples, from the
        thread that ran it, with a list of samples, one per (layer, head):
        {"layer": qualified module name, "head": int, "value": mean
        normalised entropy of the sampled rows, "modality": modality,
        "rows": [[batch, query position], ...], "row_values": [per-row
        entropy, ...], "step": forward number (1-based), "ts_ns":
        CLOCK_MONOTONIC time of the measurement}.
    modality: copied into every sample ("text", "image", ...). To tell the
        parts of a multimodal model apart, watch each tower separately.
    seed: seeds the private row-sampling generator, so a given sequence of
        forwards samples the same rows.

    A model without a recognised attention module gets a handle with
    `hooked == 0` and a RuntimeWarning; it is never an error.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"watch() expected a torch.nn.Module, got {type(model).__name__}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an integer >= 1, got {every!r}")
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ValueError(f"rows must be an integer >= 1 or None, got {rows!r}")
    if not callable(sink):
        raise TypeError(f"sink must be callable, got {type(sink).__name__}")
    return AttentionWatch(model, every=every, rows=rows, sink=sink, modality=modality, seed=seed)


# --------------------------------------------------------------------------
# Which keys a query row may attend to

# How a mask tensor says "visible".
_ATTEND_IS_TRUE = "bool: True = attend"  # transformers
_MASKED_IS_TRUE = "bool: True = masked"  # torch.nn
_ADDITIVE = "float: added to the scores; -inf / dtype minimum = masked"
_NONZERO_KEEPS = "int: nonzero = attend"  # flash-style padding masks
_BIAS_ONLY = "float: added to the scores, masks nothing"


@dataclass
class _KeyRule:
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

    def sample(self, pick_rows, batch: int, q_len: int, kv_len: int, device) -> _SampledRows:
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
            return _SampledRows(b, i, flat, keep, None, bias, math.log(kv_len + self.extra_keys))
        log_visible = visible.sum(-1).clamp(min=2).float().log()
        return _SampledRows(b, i, flat, keep, ~visible, bias, log_visible)

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
class _SampledRows:
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
        raise _Unsupported(f"mask shape {tuple(mask.shape)} (expected 2-, 3- or 4-d)")
    if convention == _BIAS_ONLY:
        return None, mask
    if mask.dtype == torch.bool:
        return (mask if convention == _ATTEND_IS_TRUE else ~mask), None
    if mask.is_floating_point():
        # Masked entries are -inf or the dtype's most negative value; any
        # other value is a bias that takes part in the softmax.
        return mask > torch.finfo(mask.dtype).min / 2, mask
    return mask != 0, None


def _hf_mask(mask) -> tuple[torch.Tensor, str]:
    if not isinstance(mask, torch.Tensor):
        raise _Unsupported(f"attention mask of type {type(mask).__name__} (expected a tensor or None)")
    if mask.dtype == torch.bool:
        return mask, _ATTEND_IS_TRUE
    return mask, _ADDITIVE if mask.is_floating_point() else _NONZERO_KEEPS


def _torch_nn_mask(mask: torch.Tensor) -> tuple[torch.Tensor, str]:
    return mask, _MASKED_IS_TRUE if mask.dtype == torch.bool else _ADDITIVE


# --------------------------------------------------------------------------
# Entropy of sampled rows


class _Unsupported(Exception):
    """An attention call whose masking this module cannot reproduce."""


def _row_scores(
    q_rows: torch.Tensor, keys: torch.Tensor, rows: _SampledRows, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """Attention logits of the sampled rows, q_rows (K, H, d) against keys
    (B, H_kv, S, d), before masking: (K, H, S) float32."""
    n_rows, heads, dim = q_rows.shape
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    if heads % kv_heads:
        raise _Unsupported(f"{heads} query heads over {kv_heads} key heads (expected a multiple)")
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


def _normalised_entropy(scores: torch.Tensor, rows: _SampledRows) -> torch.Tensor:
    """Entropy / log(visible keys) of logits (..., K, H, S) -> (..., K, H).
    Leading dimensions batch several layers into one pass."""
    if rows.hidden is not None:
        scores = scores.masked_fill(rows.hidden, float("-inf"))
    entropy = torch.special.entr(torch.softmax(scores, dim=-1)).sum(-1)
    return entropy / rows.log_visible


def _query_rows(query: torch.Tensor, rows: _SampledRows) -> torch.Tensor:
    """query (B, H, L, d) at the sampled rows -> (K, H, d)."""
    by_token = query.transpose(1, 2)  # (B, L, H, d)
    if by_token.is_contiguous():  # the usual view of a projection output: no copy
        return by_token.flatten(0, 1).index_select(0, rows.flat)
    return query[rows.b, :, rows.i, :]


# --------------------------------------------------------------------------
# transformers attention modules: measured at the attention-kernel call


class _InterfacePatch:
    """Reference-counted wrapper of `AttentionInterface.get_interface`.

    Patched on the class, so model files that keep their own interface
    instance are covered too. While no watched forward is running in the
    calling thread, the lookup returns the kernel itself.
    """

    lock = threading.Lock()
    users = 0
    original = None
    installed = None
    armed = threading.local()  # .depth: watched forwards running in this thread
    watchers: dict[nn.Module, list[tuple[AttentionWatch, str]]] = {}

    @classmethod
    def acquire(cls, watcher: AttentionWatch, modules: list[tuple[str, nn.Module]]) -> None:
        from transformers.modeling_utils import AttentionInterface

        with cls.lock:
            for name, module in modules:
                cls.watchers.setdefault(module, []).append((watcher, name))
            cls.users += 1
            if cls.users == 1:
                cls.original = AttentionInterface.__dict__["get_interface"]
                cls.installed = _make_get_interface(cls.original)
                AttentionInterface.get_interface = cls.installed

    @classmethod
    def release(cls, watcher: AttentionWatch, modules: list[tuple[str, nn.Module]]) -> None:
        from transformers.modeling_utils import AttentionInterface

        with cls.lock:
            for _, module in modules:
                remaining = [(w, n) for w, n in cls.watchers.get(module, []) if w is not watcher]
                if remaining:
                    cls.watchers[module] = remaining
                else:
                    cls.watchers.pop(module, None)
            cls.users -= 1
            if cls.users == 0:
                # Someone may have patched on top of us since; leave theirs alone.
                if AttentionInterface.__dict__.get("get_interface") is cls.installed:
                    AttentionInterface.get_interface = cls.original
                cls.original = cls.installed = None

    @classmethod
    def is_armed(cls) -> bool:
        return getattr(cls.armed, "depth", 0) > 0

    @classmethod
    def arm(cls, delta: int) -> None:
        cls.armed.depth = getattr(cls.armed, "depth", 0) + delta


def _make_get_interface(original):
    def get_interface(self, attn_implementation, default):
        kernel = original(self, attn_implementation, default)
        if not _InterfacePatch.is_armed():
            return kernel
        return _measuring_kernel(kernel, attn_implementation, kernel is default)

    get_interface.__wrapped__ = original
    get_interface.__doc__ = original.__doc__
    return get_interface


def _measuring_kernel(kernel, implementation: str | None, is_eager: bool):
    def measured(*args, **kwargs):
        out = kernel(*args, **kwargs)
        module = args[0] if args else kwargs.get("module")
        for watcher, name in _InterfacePatch.watchers.get(module, ()):
            watcher._on_kernel_call(name, module, kernel, implementation, is_eager, args, kwargs)
        return out

    return measured


def _kernel_arguments(kernel, args: tuple, kwargs: dict) -> dict:
    """Name the arguments of an attention-kernel call."""
    if len(args) <= len(_INTERFACE_ARGUMENTS):
        bound = dict(zip(_INTERFACE_ARGUMENTS, args))
        bound.update(kwargs)
        return bound
    signature = inspect.signature(kernel)
    bound = dict(signature.bind(*args, **kwargs).arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            bound.update(bound.pop(parameter.name, {}))
    return bound


def _hf_key_rule(module, bound: dict, q_len: int, kv_len: int, implementation, is_eager) -> _KeyRule:
    """Reproduce how the kernel named `implementation` masks keys."""
    rule = _KeyRule()
    mask = bound.get("attention_mask")
    if mask is not None:
        rule.masks.append(_hf_mask(mask))
    position_bias = bound.get("position_bias")
    if isinstance(position_bias, torch.Tensor):
        rule.masks.append((position_bias, _BIAS_ONLY))
    name = type(module).__name__.lower()
    rule.self_attention = "cross" not in name and not getattr(module, "is_cross_attention", False)
    module_causal = bound.get("is_causal")
    if module_causal is None:
        module_causal = getattr(module, "is_causal", True)
    impl = implementation or ""
    if is_eager or impl == "eager":
        pass  # eager kernels apply the mask they are given and nothing else
    elif impl.startswith("flash"):
        # flash kernels align the causal diagonal bottom-right and take the
        # sliding window as an argument.
        rule.causal = bool(module_causal) and q_len > 1
        rule.offset = kv_len - q_len
        window = bound.get("sliding_window")
        if window is not None and rule.causal:
            rule.window = int(window)
    else:
        # SDPA (and kernels registered in its mould) go causal, top-left
        # aligned, only when given no mask.
        rule.causal = mask is None and q_len > 1 and bool(module_causal)
    return rule


# --------------------------------------------------------------------------
# The handle


@dataclass
class _Measurement:
    layer: str
    rows: _SampledRows
    scores: torch.Tensor  # (K, H, S) logits; the entropy is taken once per forward for all layers


# Logits held per forward before their entropy is taken; past this the
# held ones are reduced at once (long contexts, many layers).
_PENDING_BYTES = 64 << 20


class AttentionWatch:
    """Handle returned by `watch`. Counters are plain ints, read any time.

    hooked: attention modules hooked (0: the model has none it recognises).
    layers: their qualified names.
    forwards: forwards of the model seen; measured_forwards: those sampled.
    unmeasured: attention calls on sampled forwards that could not be
        measured (module bypassed the attention interface, unsupported mask).
    errors: measurements that failed; sink_errors: sink calls that raised.
    """

    def __init__(self, model, *, every, rows, sink, modality, seed):
        self.every = every
        self.rows = rows
        self.modality = modality
        self.forwards = 0
        self.measured_forwards = 0
        self.unmeasured = 0
        self.errors = 0
        self.sink_errors = 0
        self._sink = sink
        self._counter = itertools.count(1)
        self._local = threading.local()
        self._generator = torch.Generator().manual_seed(seed)
        self._generator_lock = threading.Lock()
        self._warned: set[str] = set()
        self._torch_hooks: list = []
        self._hf_modules: list[tuple[str, nn.Module]] = []
        self._removed = False

        found = _find_attention_modules(model)
        self.layers = tuple(name for name, _, _ in found)
        self.hooked = len(found)
        if not found:
            warnings.warn(
                f"watch(): no attention module found in {type(model).__name__}; expected "
                "torch.nn.MultiheadAttention or a transformers attention module; nothing will be measured",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        for name, module, kind in found:
            if kind == "mha":
                hook = self._mha_hook(name)
            else:
                self._hf_modules.append((name, module))
                hook = self._hf_module_hook(name)
            self._torch_hooks.append(module.register_forward_hook(hook, with_kwargs=True))
        if self._hf_modules:
            _InterfacePatch.acquire(self, self._hf_modules)
        if any(isinstance(m, nn.TransformerEncoderLayer) for m in model.modules()):
            warnings.warn(
                "watch(): torch.nn.TransformerEncoderLayer skips its fused fast path while a module inside "
                "it has hooks, so the watched model runs the regular path, whose outputs can differ from "
                "the fast path's in the last bits",
                RuntimeWarning,
                stacklevel=3,
            )
        # Registered last so that, on a model that is itself an attention
        # module, its measurement lands before the flush.
        self._torch_hooks.append(model.register_forward_pre_hook(self._begin_forward))
        self._torch_hooks.append(model.register_forward_hook(self._end_forward, always_call=True))

    # -- lifecycle -------------------------------------------------------

    def remove(self) -> None:
        """Take every hook off; calling it again does nothing."""
        if self._removed:
            return
        self._removed = True
        for handle in self._torch_hooks:
            handle.remove()
        self._torch_hooks.clear()
        if self._hf_modules:
            _InterfacePatch.release(self, self._hf_modules)

    def __enter__(self) -> AttentionWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (
            f"AttentionWatch(hooked={self.hooked}, every={self.every}, rows={self.rows}, "
            f"forwards={self.forwards}, measured_forwards={self.measured_forwards})"
        )

    # -- per-forward state (thread-local: servers run models from many threads)

    def _state(self):
        local = self._local
        if not hasattr(local, "depth"):
            local.depth = 0
            local.pending = None  # _Measurement list while a sampled forward runs
            local.pending_bytes = 0
            local.reduced = []
            local.step = 0
            local.sampled = {}
            local.measured = set()
        return local

    def _begin_forward(self, module, args) -> None:
        state = self._state()
        state.depth += 1
        if state.depth > 1:
            return
        step = next(self._counter)
        self.forwards += 1
        if step % self.every:
            return
        state.step = step
        state.pending, state.pending_bytes, state.reduced = [], 0, []
        state.sampled = {}
        state.measured = set()
        _InterfacePatch.arm(+1)

    def _end_forward(self, module, args, output) -> None:
        state = self._state()
        state.depth -= 1
        if state.depth > 0 or state.pending is None:
            return
        pending, reduced = state.pending, state.reduced
        state.pending, state.reduced, state.sampled = None, [], {}
        _InterfacePatch.arm(-1)
        if sys.exc_info()[0] is not None:
            return  # the forward raised: its partial measurements are dropped
        self.measured_forwards += 1
        try:
            samples = self._samples(reduced + self._reduce(pending), state.step)
        except Exception as exc:
            self.errors += 1
            self._warn_once("reduce", f"attention entropy failed: {type(exc).__name__}: {exc}")
            return
        if not samples:
            return  # nothing measurable (one-token inputs, unmeasured modules)
        try:
            self._sink(samples)
        except Exception as exc:  # a broken sink must not break inference
            self.sink_errors += 1
            self._warn_once("sink", f"attention entropy sink raised {type(exc).__name__}: {exc}")

    def _hold(self, state, measurement: _Measurement) -> None:
        state.pending.append(measurement)
        state.pending_bytes += measurement.scores.numel() * measurement.scores.element_size()
        if state.pending_bytes > _PENDING_BYTES:
            state.reduced += self._reduce(state.pending)
            state.pending, state.pending_bytes = [], 0

    @staticmethod
    def _reduce(pending: list[_Measurement]) -> list[tuple[str, list, list, list]]:
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
                entropy = _normalised_entropy(torch.stack([pending[p].scores for p in positions]), rows)
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

    def _samples(self, reduced: list[tuple[str, list, list, list]], step: int) -> list[dict]:
        """One sample per (layer, head)."""
        ts_ns = time.monotonic_ns()
        samples = []
        for layer, where, head_rows, head_means in reduced:
            if not where:
                continue  # nothing measurable, e.g. a one-token sequence
            for head, (row_values, value) in enumerate(zip(head_rows, head_means)):
                samples.append(
                    {
                        "layer": layer,
                        "head": head,
                        "value": value,
                        "modality": self.modality,
                        "rows": [r[:] for r in where],
                        "row_values": row_values,
                        "step": step,
                        "ts_ns": ts_ns,
                    }
                )
        return samples

    # -- row sampling ----------------------------------------------------

    def _sampled_rows(self, state, rule: _KeyRule, sources: tuple, batch: int, q_len: int, kv_len: int, device):
        """The forward's sampled rows for this masking. Layers that share a
        mask share the rows, so sampling and mask work happen once per
        forward; the cache holds `sources` (the mask tensors as passed) so
        that their ids stay unique while it lives."""
        key = rule.cache_key(sources, batch, q_len, kv_len)
        cached = state.sampled.get(key)
        if cached is None:
            cached = (sources, rule.sample(self._pick_rows, batch, q_len, kv_len, device))
            state.sampled[key] = cached
        return cached[1]

    def _pick_rows(self, measurable: torch.Tensor):
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

    # -- transformers modules ---------------------------------------------

    def _on_kernel_call(self, name, module, kernel, implementation, is_eager, args, kwargs) -> None:
        state = self._state()
        if state.pending is None:
            return
        state.measured.add(module)
        self._measure_safely(name, lambda: self._measure_kernel_call(
            name, module, _kernel_arguments(kernel, args, kwargs), implementation, is_eager, state))

    def _measure_safely(self, name, measure) -> None:
        """Run one measurement without gradients; whatever goes wrong is
        counted and warned about once, and never fails the model's forward."""
        try:
            with torch.no_grad():
                measure()
        except _Unsupported as exc:
            self.unmeasured += 1
            self._warn_once(name, f"attention entropy of {name} not measured: unsupported {exc}")
        except Exception as exc:
            self.errors += 1
            self._warn_once(name, f"attention entropy of {name} failed: {type(exc).__name__}: {exc}")

    def _measure_kernel_call(self, name, module, bound, implementation, is_eager, state) -> None:
        query, key = bound["query"].detach(), bound["key"].detach()
        if query.dim() != 4 or key.dim() != 4:
            raise _Unsupported(
                f"query/key shapes {tuple(query.shape)}/{tuple(key.shape)} (expected (batch, heads, seq, dim))"
            )
        batch, _, q_len, dim = query.shape
        kv_len = key.shape[2]
        rule = _hf_key_rule(module, bound, q_len, kv_len, implementation, is_eager)
        rows = self._sampled_rows(state, rule, tuple(mask for mask, _ in rule.masks), batch, q_len, kv_len, query.device)
        scale = bound.get("scaling")
        scale = dim**-0.5 if scale is None else float(scale)
        scores = _row_scores(_query_rows(query, rows), key, rows, scale, softcap=bound.get("softcap"))
        self._hold(state, _Measurement(name, rows, scores))

    def _hf_module_hook(self, name):
        def hook(module, args, kwargs, output):
            state = self._state()
            if state.pending is None:
                return
            if module in state.measured:
                state.measured.discard(module)
                return
            self.unmeasured += 1
            self._warn_once(
                name,
                f"attention entropy of {name} ({type(module).__name__}) not measured: the module "
                "did not call transformers' attention interface",
            )

        return hook

    # -- torch.nn.MultiheadAttention -------------------------------------

    def _mha_hook(self, name):
        def hook(module, args, kwargs, output):
            state = self._state()
            if state.pending is None:
                return
            self._measure_safely(name, lambda: self._measure_mha(name, module, args, kwargs, state))

        return hook

    def _measure_mha(self, name, mha: nn.MultiheadAttention, args, kwargs, state) -> None:
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

        rule = _KeyRule(self_attention=self_attention)
        sources = []
        attn_mask = bound.get("attn_mask")
        if attn_mask is not None:
            sources.append(attn_mask)
            if attn_mask.dim() == 3:  # (batch * heads, L, S)
                attn_mask = attn_mask.reshape(batch, heads, q_len, kv_len)
            else:  # (L, S), shared by the batch
                attn_mask = attn_mask.reshape(1, 1, q_len, kv_len)
            rule.masks.append(_torch_nn_mask(attn_mask))
        padding = bound.get("key_padding_mask")
        if padding is not None:
            sources.append(padding)
            rule.masks.append(_torch_nn_mask(padding.reshape(batch, kv_len)))
        rule.extra_keys = int(mha.bias_k is not None) + int(mha.add_zero_attn)
        rows = self._sampled_rows(state, rule, tuple(sources), batch, q_len, kv_len, query.device)

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
        self._hold(state, _Measurement(name, rows, _row_scores(q_rows, keys, rows, dim**-0.5)))

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


# --------------------------------------------------------------------------
# Recognising attention modules


def _find_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(qualified name, module, "mha" | "hf") for each attention module.

    A transformers attention module is one carrying a config with an
    `_attn_implementation` and either query/key projection children or
    "Attention" in its class name; of nested candidates (BertAttention ->
    BertSelfAttention) only the innermost is kept.
    """
    found: dict[str, tuple[nn.Module, str]] = {}
    inside_mha: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside_mha):
            continue
        if isinstance(module, nn.MultiheadAttention):
            found[name] = (module, "mha")
            inside_mha.append(name)
        elif _looks_like_hf_attention(module):
            found[name] = (module, "hf")
    innermost = [
        name
        for name in found
        if not any(other != name and (name == "" or other.startswith(name + ".")) for other in found)
    ]
    return [(name, *found[name]) for name in innermost]


def _looks_like_hf_attention(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return False
    if "Attention" in type(module).__name__:
        return True
    return any(child in _QK_CHILD_NAMES for child, _ in module.named_children())
