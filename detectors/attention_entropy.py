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

import itertools
import sys
import threading
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from mmtrace.detectors.attention_mha import measure_mha
from mmtrace.detectors.attention_modules import find_attention_modules
from mmtrace.detectors.attention_rows import RowSampler, Unsupported
from mmtrace.detectors.attention_transformers import InterfacePatch, kernel_arguments, measure_kernel_call
from mmtrace.detectors.entropy_math import Measurement, reduce_measurements

__all__ = ["AttentionWatch", "watch"]


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
        self._sampler = RowSampler(rows, seed)
        self._warned: set[str] = set()
        self._torch_hooks: list = []
        self._hf_modules: list[tuple[str, nn.Module]] = []
        self._removed = False

        found = find_attention_modules(model)
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
            InterfacePatch.acquire(self, self._hf_modules)
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
            InterfacePatch.release(self, self._hf_modules)

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
            local.pending = None  # Measurement list while a sampled forward runs
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
        InterfacePatch.arm(+1)

    def _end_forward(self, module, args, output) -> None:
        state = self._state()
        state.depth -= 1
        if state.depth > 0 or state.pending is None:
            return
        pending, reduced = state.pending, state.reduced
        state.pending, state.reduced, state.sampled = None, [], {}
        InterfacePatch.arm(-1)
        if sys.exc_info()[0] is not None:
            return  # the forward raised: its partial measurements are dropped
        self.measured_forwards += 1
        try:
            samples = self._samples(reduced + reduce_measurements(pending), state.step)
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

    def _hold(self, state, measurement: Measurement) -> None:
        state.pending.append(measurement)
        state.pending_bytes += measurement.scores.numel() * measurement.scores.element_size()
        if state.pending_bytes > _PENDING_BYTES:
            state.reduced += reduce_measurements(state.pending)
            state.pending, state.pending_bytes = [], 0

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

    # -- transformers modules ---------------------------------------------

    def on_kernel_call(self, name, module, kernel, implementation, is_eager, args, kwargs) -> None:
        """Called by the patched `get_interface` after each kernel call of a hooked module."""
        state = self._state()
        if state.pending is None:
            return
        state.measured.add(module)
        self._measure_safely(name, state, lambda rows_for: measure_kernel_call(
            name, module, kernel_arguments(kernel, args, kwargs), implementation, is_eager, rows_for))

    def _measure_safely(self, name, state, measure) -> None:
        """Run one measurement without gradients and hold its logits;
        whatever goes wrong is counted and warned about once, and never
        fails the model's forward. `measure(rows_for)` returns the
        Measurement, choosing its rows through the forward's row cache."""

        def rows_for(*masking):
            return self._sampler.rows_for(state.sampled, *masking)

        try:
            with torch.no_grad():
                self._hold(state, measure(rows_for))
        except Unsupported as exc:
            self.unmeasured += 1
            self._warn_once(name, f"attention entropy of {name} not measured: unsupported {exc}")
        except Exception as exc:
            self.errors += 1
            self._warn_once(name, f"attention entropy of {name} failed: {type(exc).__name__}: {exc}")

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
            self._measure_safely(name, state, lambda rows_for: measure_mha(name, module, args, kwargs, rows_for))

        return hook

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
