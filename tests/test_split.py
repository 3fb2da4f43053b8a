"""Buffers over the device's max-storage-buffer-binding-size are split across binding windows.

Every registered lowering runs its samples with that limit forced to half the sample's largest
buffer (``Platform.force_limits``) on lavapipe Vulkan and llvmpipe GL, and one case per op family
(tests/support.py SPLIT_FAMILIES) runs split there, packed float16/bfloat16 on GL, and in
Chromium, all against torch. The real-size case (a
64 000-token vocabulary) is in tests/test_scale.py; tensors over max-buffer-size, held in several
buffers, in tests/test_parts.py.
"""


import pytest
import torch

from tapml.platforms.wgsl import load_lowerings
from support import LOW, in_chromium, own_wgpu, run_split_families, run_split_samples

OPS = sorted(load_lowerings())


def _all_split(split: dict) -> None:
    missing = [family for family, did in split.items() if not did]
    assert not missing, f"no buffer was split for: {', '.join(missing)}"


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_every_lowering_runs_split_onown_wgpu_vulkan():
    platform = own_wgpu("vulkan")
    try:
        _all_split(run_split_families(platform))
        split = {op: run_split_samples(platform, op) for op in OPS}
        assert sum(bool(n) for n in split.values()) >= 120  # most lowerings have a sample big enough to split
    finally:
        platform.close()


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_every_op_family_runs_split_onown_wgpu_gl():
    """GL runs the same split WGSL as Vulkan: one case per family here (every lowering's samples
    take a minute more on llvmpipe and add no path of their own); the packed dtypes below."""
    platform = own_wgpu("gl")
    try:
        _all_split(run_split_families(platform))
    finally:
        platform.close()


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_op_families_run_split_on_gl_packed(dtype):
    platform = own_wgpu("gl")  # no shader-f16 on llvmpipe GL: both dtypes are packed two per word
    try:
        split = run_split_families(platform, dtype)
        _all_split({f: did for f, did in split.items() if did is not None})
        assert sum(bool(did) for did in split.values()) >= 12
    finally:
        platform.close()


def test_forced_limits_only_tighten_and_are_reported():
    from tapml.platforms.reference import ReferencePlatform
    platform = ReferencePlatform()
    with pytest.raises(ValueError, match="unknown device limit"):
        platform.force_limits({"max-bogus": 1})
    with pytest.raises(ValueError, match="positive integer"):
        platform.force_limits({"max-buffer-size": 0})


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_forced_limit_is_min_of_device_and_override():
    platform = own_wgpu("vulkan")
    try:
        device = platform.caps()["limits"]["max-storage-buffer-binding-size"]
        platform.force_limits({"max-storage-buffer-binding-size": 4096, "max-buffer-size": 1 << 40})
        caps = platform.caps()
        assert caps["limits"]["max-storage-buffer-binding-size"] == 4096 < device
        assert caps["limits"]["max-buffer-size"] < 1 << 40  # laxer than the device: ignored
        assert caps["forced_limits"]["max-storage-buffer-binding-size"] == 4096
    finally:
        platform.close()


@in_chromium
def test_op_families_run_split_in_chromium():
    from tapml.platforms.browser import BrowserPlatform
    platform = BrowserPlatform()
    try:
        _all_split(run_split_families(platform))
        assert run_split_families(platform, torch.float16)["matmul"]
    finally:
        platform.close()
