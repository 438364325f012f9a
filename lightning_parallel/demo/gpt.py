"""A decoder-only transformer (GPT) for next-token prediction, written the usual way.

Token and position embeddings, ``depth`` pre-norm blocks (causal multi-head self-attention and a
4x MLP, each with a residual connection), a final LayerNorm and a linear head over the
vocabulary (Radford et al. 2019). The head is *not* tied to the token embedding: a pipeline
keeps every tensor on one stage, and the two sit at opposite ends of the model. With GPT-2
small's sizes (``d_model=768``, ``depth=12``, ``heads=12``, a 50,257-token vocabulary, a context
of 1,024) it has 163,037,184 parameters: GPT-2 small's 124,439,808 plus the untied head's
38,597,376.

Plain torch: the Lightning model ``GPT`` in :mod:`lightning_parallel.demo.models` wraps it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__: list[str] = []


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees itself and earlier positions."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        # (batch, length, 3·width) -> three (batch, heads, length, width/heads)
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attention(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTNetwork(nn.Module):
    """Embeddings, blocks, final norm and head: tokens ``(batch, length)`` to logits
    ``(batch, length, vocab)``."""

    def __init__(self, vocab: int, context: int, d_model: int, depth: int, heads: int) -> None:
        super().__init__()
        for name, value in (("vocab", vocab), ("context", context), ("d_model", d_model)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.token = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, heads) for _ in range(depth)))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        # GPT-2's initialization: N(0, 0.02), residual projections scaled by 1/sqrt(2·depth)
        for name, parameter in self.named_parameters():
            if parameter.dim() >= 2:
                std = 0.02 / math.sqrt(2 * depth) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(parameter, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        return self.head(self.ln(self.blocks(x)))
