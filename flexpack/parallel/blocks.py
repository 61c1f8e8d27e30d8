"""Where a model keeps its transformer blocks: a model family says it (``ModelFamily.blocks``: the attribute
holding a ``ModuleList``, or a callable of the model giving it) and :mod:`flexpack.parallel` wraps, compiles,
converts and shards what these functions find there."""

from __future__ import annotations

from typing import Callable

from torch import nn

Blocks = str | Callable[[nn.Module], nn.ModuleList]


def block_list(model: nn.Module, blocks: Blocks = "blocks") -> nn.ModuleList:
    """The model's blocks: ``getattr(model, blocks)`` for a name, ``blocks(model)`` for a callable."""
    return getattr(model, blocks) if isinstance(blocks, str) else blocks(model)


def block_path(model: nn.Module, blocks: Blocks = "blocks") -> str:
    """The dotted name of the blocks' container inside ``model`` (``"blocks"``; what float8 names layers by)."""
    if isinstance(blocks, str):
        return blocks
    container = block_list(model, blocks)
    found = [name for name, m in model.named_modules() if m is container]
    if not found:
        raise ValueError(f"the blocks of {type(model).__name__} are not one of its submodules")
    return found[0]
