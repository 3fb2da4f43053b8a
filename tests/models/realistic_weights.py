"""Models with realistic weights: heavy-tailed (Student-t) parameters, activations in the
thousands, outputs that cancel to near zero and a residual stream in the hundreds. Random
weights of unit scale hide the float errors these show (issue 27); each factory is seeded.

- ``cancelling_conv``: a convolution of 8192 terms per output (128 channels x 64 taps) at
  real-weight scale: outputs in the thousands and, after cancellation, near zero.
- ``residual_encoder``: four pre-norm encoder layers whose residual stream reaches the hundreds,
  so that some elements are differences of nearly equal large numbers.
- ``planted``: the ops the planted-bug tests corrupt (a long convolution, a square linear, a
  long row sum, a matmul), each at real-weight scale.
"""

import torch
from torch import nn


def student_t(shape, df: float, scale: float, generator) -> torch.Tensor:
    """Heavy-tailed values: a standard normal over sqrt(chi-square / df), times ``scale``."""
    z = torch.randn(shape, generator=generator)
    chi2 = torch.randn((df_int := int(df),) + tuple(shape), generator=generator).pow(2).sum(0) / df_int
    return z / chi2.sqrt() * scale


class CancellingConv(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.conv = nn.Conv1d(128, 16, 64)
        with torch.no_grad():
            w = student_t(self.conv.weight.shape, 3, 0.02, g)
            # half the output channels weigh the second 64 input channels (a copy of the first
            # 64) nearly as the negation of the first: their outputs cancel to near zero
            w[8:, 64:] = -w[8:, :64] * (1 + 1e-3 * torch.randn(w[8:, :64].shape, generator=g))
            self.conv.weight.copy_(w)
            self.conv.bias.copy_(student_t(self.conv.bias.shape, 3, 0.1, g))

    def forward(self, x):
        return self.conv(torch.cat([x, x], 1))


def cancelling_conv():
    g = torch.Generator().manual_seed(27)
    x = student_t((1, 64, 160), 3, 40.0, g)  # activations up to the thousands
    return CancellingConv(g).eval(), (x,)


class EncoderLayer(nn.Module):
    def __init__(self, d: int, g):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn_in, self.attn_out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        with torch.no_grad():
            for lin in (self.attn_in, self.attn_out, self.up, self.down):
                lin.weight.copy_(student_t(lin.weight.shape, 4, 2.0 / lin.in_features ** 0.5, g))
                lin.bias.copy_(student_t(lin.bias.shape, 4, 1.0, g))
        self.heads = 4

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.attn_in(self.norm1(x)).reshape(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        attn = torch.softmax(scores, dim=-1) @ v
        x = x + self.attn_out(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class ResidualEncoder(nn.Module):
    def __init__(self, g, d: int = 64, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(d, g) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def residual_encoder():
    g = torch.Generator().manual_seed(578)
    x = student_t((1, 32, 64), 4, 30.0, g)  # an embedding already in the tens
    return ResidualEncoder(g).eval(), (x,)


class Planted(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.conv = nn.Conv1d(128, 8, 64)
        self.proj = nn.Linear(64, 64)
        with torch.no_grad():
            self.conv.weight.copy_(student_t(self.conv.weight.shape, 3, 0.02, g))
            self.proj.weight.copy_(student_t(self.proj.weight.shape, 3, 0.2, g))

    def forward(self, x, rows, a, b):
        return self.conv(x), self.proj(a), rows.sum(-1), a @ b


def planted():
    g = torch.Generator().manual_seed(2)
    return Planted(g).eval(), (student_t((1, 128, 96), 3, 40.0, g), student_t((2, 131072), 3, 10.0, g),
                               student_t((16, 64), 3, 30.0, g), student_t((64, 64), 3, 3.0, g))
