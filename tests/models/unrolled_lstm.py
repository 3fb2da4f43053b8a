"""An LSTM unrolled over a long sequence: a graph of thousands of small nodes, for timing
``precision`` against ``migrate --dtype`` on the same model (benchmarks/NOTES.md, issue 27).

``factory`` unrolls 560 steps (over 8000 nodes); ``short`` unrolls 8 for tests."""

import torch
from torch import nn


class UnrolledLSTM(nn.Module):
    def __init__(self, inputs: int = 8, hidden: int = 16, steps: int = 560):
        super().__init__()
        self.cell = nn.LSTMCell(inputs, hidden)
        self.head = nn.Linear(hidden, 4)
        self.steps = steps

    def forward(self, x):
        h = x.new_zeros(x.shape[0], self.cell.hidden_size)
        c = torch.zeros_like(h)
        for t in range(self.steps):
            gates = x[:, t] @ self.cell.weight_ih.t() + h @ self.cell.weight_hh.t() + self.cell.bias_ih
            i, f, g, o = gates.chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        return self.head(h)


def factory(steps: int = 560):
    torch.manual_seed(0)
    return UnrolledLSTM(steps=steps).eval(), (torch.randn(2, steps, 8),)


def short():
    return factory(8)
