"""Model code that computes on complex tensors, as its authors wrote it (issue 36):

- ``llama_block``: a transformer block of Meta's reference Llama (``llama/model.py``), with its
  rotary embedding: ``precompute_freqs_cis`` builds the angles with ``torch.polar`` and
  ``apply_rotary_emb`` multiplies ``view_as_complex`` pairs, then ``view_as_real`` back;
- ``stft400`` / ``stft512``: an STFT, then magnitude and phase, then the inverse STFT (``n_fft``
  400 and 512, ``hop`` 160), as a vocoder or a spectrogram front end runs it inside the graph.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor):
    ndim = x.ndim
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim) + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, xv).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int = 64, n_heads: int = 4, max_seq_len: int = 32):
        super().__init__()
        self.attention = Attention(dim, n_heads)
        self.feed_forward = FeedForward(dim, 4 * dim)
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)
        self.head_dim = dim // n_heads
        self.max_seq_len = max_seq_len

    def forward(self, x):
        seqlen = x.shape[1]
        freqs_cis = precompute_freqs_cis(self.head_dim, self.max_seq_len * 2)[:seqlen]
        mask = torch.triu(torch.full((seqlen, seqlen), float("-inf")), diagonal=1)
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


def llama_block():
    torch.manual_seed(0)
    return TransformerBlock().eval(), (torch.randn(2, 12, 64),)


class SpectralRoundTrip(nn.Module):
    def __init__(self, n_fft: int, hop: int = 160):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft))

    def forward(self, audio):
        spec = torch.stft(audio, self.n_fft, self.hop, window=self.window, return_complex=True)
        magnitude, phase = spec.abs(), spec.angle()
        return torch.istft(torch.polar(magnitude, phase), self.n_fft, self.hop, window=self.window,
                           length=audio.shape[-1])


def stft400():
    torch.manual_seed(0)
    return SpectralRoundTrip(400).eval(), (torch.randn(1, 1600),)


def stft512():
    torch.manual_seed(0)
    return SpectralRoundTrip(512).eval(), (torch.randn(1, 2400),)


class RotateByConstant(nn.Module):
    """Pairs of features turned by a Python complex constant (``z * (0.6 + 0.8j)``), as rotary or
    phase-shift code writes it: a complex scalar in the graph's arguments."""

    def forward(self, x):
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * (0.6 + 0.8j) + 1j).flatten(-2)


def rotate_by_constant():
    torch.manual_seed(0)
    return RotateByConstant(), (torch.randn(2, 5, 8),)


class HalfRotation(nn.Module):
    """Rotary pairs in complex32, as half-precision code that keeps its angles as ``chalf`` writes
    it: float16 pairs viewed as complex, multiplied by unit complex32 factors (a buffer), added to a
    complex shift, back to float16 pairs, and the magnitude (what torch computes on complex32)."""

    def __init__(self, n: int = 4):
        super().__init__()
        angles = torch.arange(n) * 0.7
        self.register_buffer("turn", torch.polar(torch.ones(n), angles).to(torch.complex32))

    def forward(self, x):
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        r = z * self.turn - z.conj()
        return torch.view_as_real(r).flatten(-2), r.abs(), torch.cat([r, z], -1).to(torch.complex64)


def half_rotation():
    torch.manual_seed(0)
    return HalfRotation(), (torch.randn(3, 8).half(),)
