"""Activation checkpointing: a block keeps only its inputs in forward and recomputes its internal
activations during backward (non-reentrant `torch.utils.checkpoint`).

    hvdtrain.checkpoint_modules(model, MyBlock)          # every MyBlock instance
    hvdtrain.checkpoint_modules(model, "encoder.layers.*")  # by qualified name (fnmatch pattern)

State-dict keys stay those of the plain model, so checkpoints load with or without checkpointing.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hvdtrain.errors import ConfigError

_PREFIX = "module."


class Checkpointed(nn.Module):
    """Runs `module` with activation checkpointing during training; plain forward otherwise."""

    hvdtrain_checkpointed = True  # found by the memory profiler, which counts the held inputs

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._norms: list[nn.Module] = [m for m in module.modules()
                                        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.module(*args, **kwargs)
        return checkpoint(self.module, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), _keep_running_stats(self._norms)


@contextlib.contextmanager
def _keep_running_stats(norms: list[nn.Module]) -> Iterator[None]:
    # The recomputation runs BatchNorm in training mode a second time; without this the running
    # mean/var would take two momentum updates per step (the gradient is unaffected either way).
    saved = [{k: b.clone() for k, b in m.named_buffers(recurse=False)} for m in norms]
    try:
        yield
    finally:
        for m, buffers in zip(norms, saved):
            for k, b in buffers.items():
                getattr(m, k).copy_(b)


def _strip_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + _PREFIX)]:
        state_dict[prefix + key[len(prefix + _PREFIX):]] = state_dict.pop(key)


def _add_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + _PREFIX)]:
        state_dict[prefix + _PREFIX + key[len(prefix):]] = state_dict.pop(key)


def checkpoint_modules(model: nn.Module, *match: type | str) -> int:
    """Wrap every submodule of `model` that is an instance of one of the given types, or whose
    qualified name (as in `named_modules`) matches one of the given fnmatch patterns. Matches nested
    inside a wrapped module, and modules already wrapped, are left alone. Returns how many modules
    were wrapped; raises ConfigError if nothing matched."""
    types = tuple(m for m in match if isinstance(m, type))
    patterns = [m for m in match if isinstance(m, str)]
    chosen: list[tuple[nn.Module, str]] = []

    def walk(parent: nn.Module, prefix: str) -> None:
        for name, child in parent.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, Checkpointed):
                continue
            if isinstance(child, types) or any(fnmatch.fnmatchcase(full, p) for p in patterns):
                chosen.append((parent, name))
            else:
                walk(child, full + ".")

    walk(model, "")
    if not chosen:
        labels = ", ".join(m.__name__ if isinstance(m, type) else repr(m) for m in match)
        raise ConfigError(f"activation checkpointing: no submodule matches {labels}")
    for parent, name in chosen:
        setattr(parent, name, Checkpointed(getattr(parent, name)))
    return len(chosen)


def checkpoint_blocks(model: nn.Module) -> int:
    """`memory.activation_checkpointing`: wrap each entry of the model's `blocks` ModuleList (the
    built-in GPT blocks, ResNet basic blocks and CNN stages); already wrapped blocks are kept."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ConfigError("memory.activation_checkpointing needs a model with a `blocks` nn.ModuleList; "
                          "for other models call hvdtrain.checkpoint_modules(model, BlockType) before fit")
    for i, block in enumerate(blocks):
        if not isinstance(block, Checkpointed):
            blocks[i] = Checkpointed(block)
    return len(blocks)
