"""transformers attention modules, measured at the attention-kernel call.

Every transformers attention module obtains its kernel through
`AttentionInterface.get_interface(...)`. While a watched forward runs, that
lookup returns the kernel wrapped in a function that calls it unchanged and
then measures its (query, key, mask, scaling) arguments: the tensors after
the module's own projections, norms, rotary embedding and KV cache.
"""

from __future__ import annotations

import inspect
import threading
from typing import Protocol

import torch
from torch import nn

from mmtrace.detectors.attention_rows import BIAS_ONLY, KeyRule, Unsupported, hf_mask
from mmtrace.detectors.entropy_math import Measurement, query_rows, row_scores

_INTERFACE_ARGUMENTS = ("module", "query", "key", "value", "attention_mask")


class KernelWatcher(Protocol):
    """What the patched lookup tells about each kernel call of a watched module."""

    def on_kernel_call(self, name, module, kernel, implementation, is_eager, args, kwargs) -> None: ...


class InterfacePatch:
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
    watchers: dict[nn.Module, list[tuple[KernelWatcher, str]]] = {}

    @classmethod
    def acquire(cls, watcher: KernelWatcher, modules: list[tuple[str, nn.Module]]) -> None:
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
    def release(cls, watcher: KernelWatcher, modules: list[tuple[str, nn.Module]]) -> None:
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
        if not InterfacePatch.is_armed():
            return kernel
        return _measuring_kernel(kernel, attn_implementation, kernel is default)

    get_interface.__wrapped__ = original
    get_interface.__doc__ = original.__doc__
    return get_interface


def _measuring_kernel(kernel, implementation: str | None, is_eager: bool):
    def measured(*args, **kwargs):
        out = kernel(*args, **kwargs)
        module = args[0] if args else kwargs.get("module")
        for watcher, name in InterfacePatch.watchers.get(module, ()):
            watcher.on_kernel_call(name, module, kernel, implementation, is_eager, args, kwargs)
        return out

    return measured


def kernel_arguments(kernel, args: tuple, kwargs: dict) -> dict:
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


def _key_rule(module, bound: dict, q_len: int, kv_len: int, implementation, is_eager) -> KeyRule:
    """Reproduce how the kernel named `implementation` masks keys."""
    rule = KeyRule()
    mask = bound.get("attention_mask")
    if mask is not None:
        rule.masks.append(hf_mask(mask))
    position_bias = bound.get("position_bias")
    if isinstance(position_bias, torch.Tensor):
        rule.masks.append((position_bias, BIAS_ONLY))
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


def measure_kernel_call(name, module, bound: dict, implementation, is_eager, rows_for) -> Measurement:
    """The logits of the sampled rows of one kernel call, from its named
    arguments; `rows_for` is the forward's RowSampler.rows_for."""
    query, key = bound["query"].detach(), bound["key"].detach()
    if query.dim() != 4 or key.dim() != 4:
        raise Unsupported(
            f"query/key shapes {tuple(query.shape)}/{tuple(key.shape)} (expected (batch, heads, seq, dim))"
        )
    batch, _, q_len, dim = query.shape
    kv_len = key.shape[2]
    rule = _key_rule(module, bound, q_len, kv_len, implementation, is_eager)
    rows = rows_for(rule, tuple(mask for mask, _ in rule.masks), batch, q_len, kv_len, query.device)
    scale = bound.get("scaling")
    scale = dim**-0.5 if scale is None else float(scale)
    scores = row_scores(query_rows(query, rows), key, rows, scale, softcap=bound.get("softcap"))
    return Measurement(name, rows, scores)
