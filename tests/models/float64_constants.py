"""Model code that keeps constants in float64 (issue 36 item 6), as such code is written: a
per-channel scale and a threshold registered as float64 buffers and brought to the activations'
dtype (or compared against them) in ``forward``.

- ``exact``: every float64 value is one float32 holds exactly (0.5, -1.25, 3.0, ...): the graph
  migrates whole, the constants held as float32;
- ``inexact``: a scale of 0.1, which float32 does not hold: the ops reading it stay on the
  reference, refused with the reason.
"""

import torch
from torch import nn


class ScaledGate(nn.Module):
    def __init__(self, scale, threshold: float):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.register_buffer("scale", torch.tensor(scale, dtype=torch.float64))
        self.register_buffer("threshold", torch.tensor(threshold, dtype=torch.float64))

    def forward(self, x):
        h = self.proj(x) * self.scale.to(x.dtype)
        gate = h > self.threshold  # compared in float64 by torch
        return torch.where(gate, h, torch.zeros_like(h)).sum(-1)


def _model(scale):
    torch.manual_seed(0)
    return ScaledGate(scale, 0.125).eval(), (torch.randn(3, 6),)


def exact():
    return _model([0.5, -1.25, 3.0, 2.0, 0.0, 1.0])


def inexact():
    return _model([0.1, -1.25, 3.0, 2.0, 0.0, 1.0])
