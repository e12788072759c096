"""A synthetic diffusion transformer with a denoising loop, for offload tests, benchmarks and the demo.

The block is the benchmark workload's block (pre-norm attention + 4x GELU MLP, no affine norms): at
hidden 3072 / 24 heads it is 227 MB in bf16, like a Flux block. The model adds what makes it a DiT: a
latent input projection, a timestep embedding (whose frequency table is a non-persistent buffer) and
an output projection. ``SyntheticDiTPipeline`` runs an Euler flow-matching loop over it and declares an
``OffloadPlan``. ``tiny_flux_transformer`` builds a real diffusers Flux transformer with random weights
(needs the ``diffusers`` extra; nothing is downloaded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from weight_sync.offload.plan import OffloadPlan

__all__ = [
    "DiTBlock",
    "DiTConfig",
    "SyntheticDiT",
    "SyntheticDiTPipeline",
    "make_latents",
    "tiny_flux_inputs",
    "tiny_flux_transformer",
]


@dataclass(frozen=True, kw_only=True)
class DiTConfig:
    """Shape of the synthetic DiT. ``flux()`` is the benchmark size (16 x 227 MB bf16 blocks)."""

    hidden: int = 64
    heads: int = 4
    num_blocks: int = 4
    mlp_ratio: int = 4
    in_channels: int = 16
    time_dim: int = 64

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.num_blocks < 1 or self.time_dim % 2:
            raise ValueError(
                f"num_blocks must be >= 1 and time_dim even, got {self.num_blocks} / {self.time_dim}"
            )

    @classmethod
    def flux(cls, num_blocks: int = 16) -> DiTConfig:
        return cls(hidden=3072, heads=24, num_blocks=num_blocks, mlp_ratio=4, in_channels=64, time_dim=256)


class DiTBlock(nn.Module):
    """Pre-norm self-attention and a GELU MLP (the benchmark anchor's block)."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.fc1 = nn.Linear(hidden, mlp_ratio * hidden)
        self.fc2 = nn.Linear(mlp_ratio * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(F.layer_norm(x, (d,))).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(F.layer_norm(x, (d,))), approximate="tanh"))


class SyntheticDiT(nn.Module):
    """Latent tokens in, velocity out: proj_in + timestep embedding, blocks, norm + proj_out."""

    _layerwise_offload_blocks_attrs = ("blocks",)

    def __init__(self, config: DiTConfig | None = None) -> None:
        super().__init__()
        self.config = c = config or DiTConfig()
        self.proj_in = nn.Linear(c.in_channels, c.hidden)
        self.time_embed = nn.Sequential(nn.Linear(c.time_dim, c.hidden), nn.SiLU(), nn.Linear(c.hidden, c.hidden))
        half = c.time_dim // 2
        # Derived, not loaded: a non-persistent buffer, like the RoPE tables of real DiTs.
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("time_freqs", freqs, persistent=False)
        self.blocks = nn.ModuleList(DiTBlock(c.hidden, c.heads, c.mlp_ratio) for _ in range(c.num_blocks))
        self.norm_out = nn.LayerNorm(c.hidden)
        self.proj_out = nn.Linear(c.hidden, c.in_channels)

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        freqs = cast(torch.Tensor, self.time_freqs)
        args = timestep.float()[:, None] * 1000.0 * freqs[None, :]
        temb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(latents.dtype)
        x = self.proj_in(latents) + self.time_embed(temb)[:, None, :]
        for block in self.blocks:
            x = block(x)
        return self.proj_out(self.norm_out(x))


def make_latents(
    *, batch: int, tokens: int, channels: int, seed: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Gaussian noise drawn on the CPU (identical on every device and run) and moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, channels, generator=g).to(dtype=dtype, device=device)


class SyntheticDiTPipeline(nn.Module):
    """A minimal diffusion pipeline: a transformer and an Euler flow-matching sampler."""

    _dit_modules = ("transformer",)
    _offload_plan = OffloadPlan(
        block_attrs={"transformer": ("blocks",)}, resident_dit_paths=("transformer.blocks",)
    )

    def __init__(self, config: DiTConfig | None = None, *, transformer: SyntheticDiT | None = None) -> None:
        super().__init__()
        self.transformer = transformer if transformer is not None else SyntheticDiT(config)

    @torch.no_grad()
    def forward(
        self, latents: torch.Tensor, *, num_inference_steps: int, callback: Any = None
    ) -> torch.Tensor:
        if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be an int >= 1, got: {num_inference_steps!r}")
        x = latents
        sigmas = torch.linspace(1.0, 0.0, num_inference_steps + 1).tolist()
        for i in range(num_inference_steps):
            t = torch.full((x.shape[0],), sigmas[i], device=x.device)
            v = self.transformer(x, t)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
            if callback is not None:
                callback(i, x)
        return x

    def generate(
        self, *, batch: int = 1, tokens: int = 32, num_inference_steps: int = 4, seed: int = 0,
        dtype: torch.dtype | None = None, device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Denoise fresh noise from ``seed``; dtype/device default to the transformer's proj_in."""
        ref = self.transformer.proj_in.weight
        latents = make_latents(
            batch=batch, tokens=tokens, channels=self.transformer.config.in_channels, seed=seed,
            dtype=dtype or ref.dtype, device=device or ref.device,
        )
        return self(latents, num_inference_steps=num_inference_steps)


def tiny_flux_transformer(*, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A diffusers ``FluxTransformer2DModel`` with 2 double + 2 single blocks and random weights."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = cast(nn.Module, FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    ))
    return model.to(dtype).eval()


def tiny_flux_inputs(
    *, seed: int = 0, batch: int = 1, height: int = 4, width: int = 4, text_tokens: int = 6,
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Keyword inputs for ``tiny_flux_transformer`` (image latents, text states, ids, timestep)."""
    g = torch.Generator().manual_seed(seed)
    n = height * width
    img_ids = torch.zeros(height, width, 3)
    img_ids[..., 1] = torch.arange(height)[:, None]
    img_ids[..., 2] = torch.arange(width)[None, :]
    out = {
        "hidden_states": torch.randn(batch, n, 8, generator=g),
        "encoder_hidden_states": torch.randn(batch, text_tokens, 32, generator=g),
        "pooled_projections": torch.randn(batch, 32, generator=g),
        "timestep": torch.full((batch,), 0.5),
        "img_ids": img_ids.reshape(n, 3),
        "txt_ids": torch.zeros(text_tokens, 3),
    }
    return {
        k: v.to(device=device, dtype=dtype if v.is_floating_point() and k not in ("img_ids", "txt_ids") else v.dtype)
        for k, v in out.items()
    }
