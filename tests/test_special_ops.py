"""Device tier: accuracy of the special-function lowerings (platforms/wgsl/special.py) and of the
elementwise transcendentals (platforms/wgsl/elementwise.py) over their whole domain, in f32 ulps against torch's float64 result, on lavapipe Vulkan and llvmpipe GL.

The registry's generated tests check the default tolerances on a few samples; these sweep dense
grids (tiny to huge arguments, the regions around zeros and poles) and hold each function to the
few ulps its algorithm promises. Excluded: arguments near the zeros of lgamma and digamma at
negative x, where the reflection formula's cancellation is inherent (the error there is small
in absolute terms, which the registry tests check).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tapml.platforms.wgpu_native import available_backends, shared_platform
from tapml.platforms.wgsl.registry import case_graph

BACKENDS = available_backends()
pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not BACKENDS, reason="no wgpu adapter (install mesa-vulkan-drivers for lavapipe)")]

_POS = torch.logspace(-30, 38, 20000).float()
_WIDE = torch.cat([_POS, -_POS, torch.linspace(-12, 12, 20001)])
_HYP = _POS[_POS < 89.4]
_UNIT = torch.cat([_POS[_POS <= 1], -_POS[_POS <= 1], torch.linspace(-1, 1, 40001), 1 - torch.logspace(-7.2, -1, 2000)])
#: positive normals and denormals, and [0.5, 2] where the drivers' log is accurate only in absolute terms
_LOG = torch.cat([_POS, torch.logspace(-45, -38, 2000), torch.linspace(0.5, 2, 40001)])

# op, extra leading args, arguments, float64 reference, ulp bound
SWEEPS = {
    "erfc": ("aten.erfc.default", (), _WIDE, torch.erfc, 8),
    "erfcx": ("aten.special_erfcx.default", (), _WIDE[_WIDE > -9], torch.special.erfcx, 8),
    "erfinv": ("aten.erfinv.default", (), torch.cat([torch.linspace(-1, 1, 40001)[1:-1], 1 - torch.logspace(-7.2, -1, 2000),
                                                     torch.logspace(-30, -1, 2000)]), torch.erfinv, 6),
    "lgamma": ("aten.lgamma.default", (), torch.cat([_POS, torch.linspace(0.5, 3, 40001), torch.linspace(-0.49, 0, 2000)]),
               torch.lgamma, 16),
    "digamma": ("aten.digamma.default", (), torch.cat([_POS[_POS < 1e30], torch.linspace(0.01, 12, 40001)]), torch.digamma, 6),
    "trigamma": ("aten.polygamma.default", (1,), torch.linspace(-0.99, 40, 40001), lambda x: torch.polygamma(1, x), 12),
    "polygamma3": ("aten.polygamma.default", (3,), torch.linspace(0.01, 40, 40001), lambda x: torch.polygamma(3, x), 12),
    "i0": ("aten.i0.default", (), torch.linspace(-88, 88, 40001), torch.i0, 8),
    "i0e": ("aten.special_i0e.default", (), torch.cat([torch.linspace(-90, 90, 40001), _POS]), torch.special.i0e, 8),
    "i1": ("aten.special_i1.default", (), torch.linspace(-88, 88, 40001), torch.special.i1, 8),
    "modified_bessel_i0": ("aten.special_modified_bessel_i0.default", (), torch.linspace(-88, 88, 40001),
                           torch.special.modified_bessel_i0, 8),
    "modified_bessel_i1": ("aten.special_modified_bessel_i1.default", (), torch.linspace(-88, 88, 40001),
                           torch.special.modified_bessel_i1, 8),
    # tiny p (down to the denormals) keep their relative accuracy: no 2p - 1 rounding to -1
    "ndtri": ("aten.special_ndtri.default", (), torch.cat([torch.logspace(-45, -0.31, 20000), torch.linspace(0, 1, 40001)[1:-1],
                                                           1 - torch.logspace(-7.2, -0.31, 2000)]), torch.special.ndtri, 6),
    "angle": ("aten.angle.default", (), _WIDE, torch.angle, 1),
    "i1e": ("aten.special_i1e.default", (), torch.cat([torch.linspace(-90, 90, 40001), _POS]), torch.special.i1e, 8),
    # near 0 these are relative, not absolute, accuracy (log(1 + x) and exp(x) - 1 of the drivers lose every digit)
    "log1p": ("aten.log1p.default", (), torch.cat([_POS[_POS < 1e30], -_POS[_POS < 0.99]]), torch.log1p, 4),
    "expm1": ("aten.expm1.default", (), torch.cat([_POS[_POS < 2], -_POS[_POS < 80]]), torch.expm1, 8),
    # the elementwise transcendentals: relative accuracy for tiny arguments and near 1 (log), no
    # premature overflow (sinh and cosh up to 89.4), the half-angle and octant reductions' seams
    "sinh": ("aten.sinh.default", (), torch.cat([_HYP, -_HYP, torch.linspace(-89.4, 89.4, 40001)]), torch.sinh, 8),
    "cosh": ("aten.cosh.default", (), torch.cat([_HYP, -_HYP, torch.linspace(-89.4, 89.4, 40001)]), torch.cosh, 8),
    "tanh": ("aten.tanh.default", (), _WIDE, torch.tanh, 6),
    "atan": ("aten.atan.default", (), torch.cat([_WIDE, torch.linspace(-3, 3, 40001)]), torch.atan, 4),
    "asin": ("aten.asin.default", (), _UNIT, torch.asin, 4),
    "acos": ("aten.acos.default", (), torch.cat([_UNIT, -1 + torch.logspace(-7.2, -1, 2000)]), torch.acos, 4),
    "log": ("aten.log.default", (), _LOG, torch.log, 4),
    "log2": ("aten.log2.default", (), _LOG, torch.log2, 4),
    "log10": ("aten.log10.default", (), _LOG, torch.log10, 4),
}


def _platform(backend):
    if backend not in BACKENDS:
        pytest.skip(f"no {backend} adapter here (have: {', '.join(BACKENDS)})")
    return shared_platform(backend)


def _ulp_error(platform, op, lead, x, reference):
    graph, inputs = case_graph(op, [*lead, x])
    out = platform.run(platform.compile(graph), inputs)[0].double()
    ref = reference(x.double())
    judged = torch.isfinite(ref) & (ref.abs() > 1e-37) & (ref.abs() < 3.4e38)
    spacing = torch.from_numpy(np.spacing(ref.float().abs().numpy())).double()
    err = ((out - ref).abs() / spacing)[judged]
    worst = int(err.argmax())
    return float(err.max()), float(x[judged][worst])


@pytest.mark.parametrize("backend", ["vulkan", "gl"])
@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_special_function_is_accurate_to_a_few_ulp(backend, name):
    op, lead, x, reference, bound = SWEEPS[name]
    err, where = _ulp_error(_platform(backend), op, lead, x, reference)
    assert err <= bound, f"{name} on {backend}: {err:.1f} ulp at x={where!r} (bound {bound})"


# op, x grid, orders n, float64 reference, bound on the error relative to the largest |p_n(x)| of each order
# over the grid (the f32 recurrence's own cancellation near the zeros is of that size)
POLYNOMIALS = {
    "hermite_h": ("aten.special_hermite_polynomial_h.default", torch.linspace(-6, 6, 2001), range(0, 41),
                  torch.special.hermite_polynomial_h, 1e-5),
    "hermite_he": ("aten.special_hermite_polynomial_he.default", torch.linspace(-6, 6, 2001), range(0, 41),
                   torch.special.hermite_polynomial_he, 1e-5),
    "laguerre_l": ("aten.special_laguerre_polynomial_l.default", torch.linspace(-4, 30, 2001), range(0, 31),
                   torch.special.laguerre_polynomial_l, 1e-5),
    "legendre_p": ("aten.special_legendre_polynomial_p.default", torch.linspace(-1, 1, 2001), range(0, 61),
                   torch.special.legendre_polynomial_p, 1e-5),
}


@pytest.mark.parametrize("backend", ["vulkan", "gl"])
@pytest.mark.parametrize("name", sorted(POLYNOMIALS))
def test_orthogonal_polynomial_is_accurate(backend, name):
    platform = _platform(backend)
    op, x, orders, reference, bound = POLYNOMIALS[name]
    n = torch.tensor(list(orders), dtype=torch.float32)[:, None]
    graph, inputs = case_graph(op, [x[None, :], n])
    out = platform.run(platform.compile(graph), inputs)[0].double()
    ref = reference(x.double()[None, :], n.double())
    scale = ref.abs().amax(dim=1, keepdim=True)
    err = ((out - ref).abs() / scale).max(dim=1).values
    worst = int(err.argmax())
    assert float(err[worst]) <= bound, f"{name} on {backend}: error {float(err[worst]):.2e} of max|p| at n={worst} (bound {bound})"
