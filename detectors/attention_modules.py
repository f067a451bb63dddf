"""Recognising the attention modules of a model, per family: torch
`nn.MultiheadAttention`, and transformers attention modules (measured at
their attention-kernel call)."""

from __future__ import annotations

from torch import nn

# Child names that hold query/key projections in transformers attention
# modules (separate, or fused into one matrix).
_QK_CHILD_NAMES = frozenset(
    {"q_proj", "k_proj", "query", "key", "q", "k", "qkv", "qkv_proj", "c_attn", "Wqkv", "query_key_value", "in_proj"}
)


def find_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
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
