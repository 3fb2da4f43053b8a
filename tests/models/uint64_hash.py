"""Model code on uint64 (issue 36 item 1): a multiplicative hash of token ids, as feature-hashing
and n-gram embedding code writes it (torch implements few ops for uint64: multiplication, bitwise
and/xor, equality, sums, sorts, casts and moves are what this uses).
"""

import torch
from torch import nn


class HashedBuckets(nn.Module):
    def __init__(self, buckets: int = 1 << 12):
        super().__init__()
        self.buckets = buckets
        self.register_buffer("salt", torch.tensor([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9],
                                                  dtype=torch.uint64))
        self.table = nn.Embedding(buckets, 8)

    def forward(self, ids):
        h = ids.to(torch.uint64).unsqueeze(-1) * 0xFF51AFD7ED558CCD  # wraps modulo 2**64, as C does
        h = h ^ self.salt
        mixed = h.sum(-1)
        order = torch.sort(mixed, dim=-1).values
        same = (order[..., 1:] == order[..., :-1]).sum(-1)
        bucket = (mixed & (self.buckets - 1)).to(torch.int64)
        return self.table(bucket).sum(1), same, order


def model():
    torch.manual_seed(0)
    return HashedBuckets().eval(), (torch.randint(0, 50000, (2, 16)),)
