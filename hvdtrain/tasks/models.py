"""Built-in models. Each exposes its repeated blocks as `self.blocks` (an nn.ModuleList) so
whole-block features (activation checkpointing, per-block profiling) can find them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.config import ModelConfig


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and a small head for 8x8 grey digits."""

    def __init__(self, width: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        ])
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * 16, 64), nn.ReLU(), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class SignalCNN(nn.Module):
    """Three 1-D convolutions (the last two stride 2) and a linear head, for MNIST-1D's 40-point signals."""

    def __init__(self, width: int = 32, num_classes: int = 10, length: int = 40) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv1d(1, width, 5, padding=2), nn.ReLU()),
            nn.Sequential(nn.Conv1d(width, width, 3, stride=2, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv1d(width, width, 3, stride=2, padding=1), nn.ReLU()),
        ])
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(width * ((length + 3) // 4), num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet(nn.Module):
    """A ResNet-style classifier: stem, three stages of two basic blocks (width, 2w, 4w)."""

    def __init__(self, width: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        chans = [width, width, 2 * width, 2 * width, 4 * width, 4 * width]
        strides = [1, 1, 2, 1, 2, 1]
        cins = [width] + chans[:-1]
        self.blocks = nn.ModuleList(BasicBlock(i, o, s) for i, o, s in zip(cins, chans, strides))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        width = 4 * cfg.n_embd
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, width), nn.GELU(), nn.Linear(width, cfg.n_embd), nn.Dropout(cfg.dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A byte-level (vocabulary 256) decoder-only transformer with tied input/output embeddings."""

    vocab_size = 256

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.tok = nn.Embedding(self.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, self.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat in depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def pipeline_layers(self) -> list[nn.Module]:
        """Where pipeline stages may cut it (hvdtrain/parallel/partition.py): embeddings, each block,
        head. The first and last share the tied embedding weight."""
        return [_Embed(self), *self.blocks, _Head(self)]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class _Embed(nn.Module):
    """GPT's token and position embeddings: the first layer of its pipeline cut."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.tok, self.pos, self.drop = gpt.tok, gpt.pos, gpt.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))


class _Head(nn.Module):
    """GPT's final norm and the output projection (its weight is the token embedding's)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
