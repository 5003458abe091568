"""The kernel catalog and the routing from a call to a compiled kernel, on the CPU: the tier rule, the fallback of a
tier that lacks a kernel, the override, the errors of a build without the kernel, and the cache of resolutions."""

import sys
from pathlib import Path

import pytest
import torch

from flash_attention import _catalog, _dispatch, _ops

ROOT = Path(__file__).resolve().parent.parent


def cc_id(cc):
    return f"cc{cc[0]}{cc[1]}"


# ---------------------------------------------------------------------------------------------------------------
# The catalog

def test_catalog_is_consistent():
    assert list(_catalog.HEAD_DIMS) == sorted(set(_catalog.HEAD_DIMS)) and _catalog.MAX_HEAD_DIM == 256
    assert len({tier.id for tier in _catalog.TIERS.values()}) == len(_catalog.TIERS)
    for tier in _catalog.TIERS.values():
        assert tier.kinds and set(tier.archs) <= {a for t in _catalog.TIERS.values() for a in t.archs}
        for kind in tier.kinds.values():
            assert set(kind.head_dims) <= set(_catalog.HEAD_DIMS)
            assert (ROOT / "csrc" / kind.header).exists()
        for folder in tier.header_dirs:
            assert (ROOT / "csrc" / folder).is_dir()
        if tier.fallback is not None:
            fallback = _catalog.TIERS[tier.fallback]
            # The fallback must run wherever this tier does and serve every kind and head dim it lacks.
            assert fallback.runs_on(tier.capabilities[0]) and fallback.runs_on(tier.capabilities[1])
            assert set(tier.kinds) <= set(fallback.kinds)
    for name_in, name_out in _catalog.DTYPE_PAIRS:
        assert name_in in _catalog.DTYPES and name_out in _catalog.DTYPES
    assert set(_catalog.DEFAULT_ARCHS) <= {a for t in _catalog.TIERS.values() for a in t.archs}


def test_build_reads_the_catalog():
    """generate_kernels writes one source per (tier, kind, head dim, dtype pair) of the catalog, and nothing else."""
    sys.path.insert(0, str(ROOT / "csrc"))
    try:
        import generate_kernels as gen
    finally:
        sys.path.pop(0)
    keys = {(s.tier, s.kind, s.head_dim, s.dtypes) for s in gen.kernel_sources()}
    expected = {(name, kind, d, pair) for name, tier in _catalog.TIERS.items() for kind, spec in tier.kinds.items()
                for d in spec.head_dims for pair in _catalog.DTYPE_PAIRS}
    assert keys == expected
    # A build restricted to some head dims still gets the kinds whose one head dim serves them all.
    restricted = {(s.kind, s.head_dim) for s in gen.kernel_sources(head_dims=[64], dtypes=["bf16"])}
    assert {kind for kind, _ in restricted} == {kind for tier in _catalog.TIERS.values() for kind in tier.kinds}
    assert all(d == 64 or _catalog.TIERS["sm80"].kinds[kind].any_head_dim for kind, d in restricted)
    text = gen.kernel_sources(tiers=["sm90"], kinds=["fwd"], head_dims=[128], dtypes=["bf16"])[0].text()
    assert 'flash::KernelKey{90, "fwd", 128, flash::DType::kBFloat16, flash::DType::kBFloat16}' in text
    assert "flash::sm90::fwd_descriptor<128, cutlass::bfloat16_t, cutlass::bfloat16_t>()" in text


def test_page_multiple_matches_the_sm90_tiles():
    """The catalog's page multiple of the SM90 forward is the one its paged TMA boxes assume."""
    text = (ROOT / "csrc" / "sm90" / "tile_traits.h").read_text()
    assert f"constexpr int kPageMultiple = {_catalog.TIERS['sm90'].kinds['fwd'].page_multiple};" in text
    # Pages of a multiple of the TMA boxes' rows are not copied row by row (kvcache.py's gather choice reads it).
    assert f"constexpr int kPageBoxRows = {_catalog.TIERS['sm90'].kinds['fwd'].page_box_rows};" in text


@pytest.mark.parametrize("page_size, head_dim, reads", [(16, 128, True), (48, 160, True), (64, 64, True),
                                                        (256, 96, False), (16, 72, False), (8, 128, False)])
def test_sm90_forward_reads_pages_by_size_and_head_dim(page_size, head_dim, reads):
    """The SM90 forward reads pages of a multiple of 16 rows at the kernel head dims of whole 128-byte rows (64, 128,
    192, 256: its row copies assume them); d 96's kernel (d 65-96) gets its pages gathered; the SM80 tier reads any."""
    assert _ops.forward_reads_pages("sm90", page_size, head_dim) is reads
    assert _ops.forward_reads_pages("sm80", page_size, head_dim) is True
    # sm90/tile_traits.h's reads_pages, which the kernel's unsupported_fwd applies.
    kind = _catalog.TIERS["sm90"].kinds["fwd"]
    assert kind.paged_head_dims == tuple(d for d in kind.head_dims if d % 64 == 0)
    text = (ROOT / "csrc" / "sm90" / "tile_traits.h").read_text()
    assert "constexpr bool reads_pages(int head_dim) { return head_dim % 64 == 0; }" in text


def test_compile_check_covers_every_tier_and_kind():
    """CI compiles one file of each tier and kind, those compiled at one head dim (append) included."""
    sys.path.insert(0, str(ROOT / "csrc"))
    try:
        import compile_check
    finally:
        sys.path.pop(0)
    checked = [(s.tier, s.kind) for s in compile_check.sources_to_check()]
    assert sorted(checked) == sorted((name, kind) for name, tier in _catalog.TIERS.items() for kind in tier.kinds)


@pytest.mark.parametrize(
    "d, expected",
    [(8, 32), (32, 32), (40, 64), (64, 64), (72, 96), (96, 96), (104, 128), (128, 128), (136, 192), (160, 192),
     (192, 192), (200, 256), (224, 256), (256, 256)],
    ids=lambda x: str(x),
)
def test_kernel_head_dim(d, expected):
    assert _catalog.kernel_head_dim(d) == expected


@pytest.mark.parametrize("d", [8, 64, 72, 128, 256])
def test_any_head_dim_kind_resolves_to_its_one_kernel(d):
    """The append kernel is compiled once, at head dim 256, and serves every head dim; the other kinds keep the
    ladder (a lookup at the ladder's dim would find no append kernel, and the kernel path would never run)."""
    assert _dispatch.kernel_key("sm80", "append", d, "bf16")[2] == 256
    assert _dispatch.kernel_key("sm80", "fwd", d, "bf16")[2] == _catalog.kernel_head_dim(d)


def test_kernel_head_dim_too_large():
    with pytest.raises(ValueError, match="head dim must be at most 256, got 264"):
        _catalog.kernel_head_dim(264)


# ---------------------------------------------------------------------------------------------------------------
# Tier selection and routing

@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1)], ids=cc_id)
def test_default_tier(cc):
    assert _dispatch.select_tier(cc) == ("sm90" if cc == (9, 0) else "sm80")


def key(tier, kind, d, dtype="bf16"):
    return (tier, kind, d, dtype, dtype)


SM90_AND_SM80 = frozenset({key(90, "fwd", 128), key(80, "fwd", 128), key(80, "fwd", 96), key(80, "bwd", 128)})


@pytest.mark.parametrize(
    "available, tier, head_dim, kind, requested, expected",
    [
        (SM90_AND_SM80, "sm90", 128, "fwd", False, "sm90"),
        (SM90_AND_SM80, "sm90", 96, "fwd", False, "sm80"),  # a head dim the SM90 tier lacks
        (SM90_AND_SM80, "sm90", 128, "bwd", False, "sm80"),  # no SM90 backward: the SM80 one
        (SM90_AND_SM80, "sm90", 96, "fwd", True, "sm80"),  # requested, built, but not for this head dim
        (SM90_AND_SM80 - {key(90, "fwd", 128)}, "sm90", 128, "fwd", False, "sm80"),  # default tier not built
        (SM90_AND_SM80 - {key(90, "fwd", 128)}, "sm90", 128, "fwd", True, "sm90"),  # requested: error later
        (SM90_AND_SM80, "sm80", 128, "fwd", False, "sm80"),
        (frozenset({key(90, "fwd", 128)}), "sm90", 96, "fwd", False, "sm90"),  # nothing to route to: error later
    ],
)
def test_routed_tier(available, tier, head_dim, kind, requested, expected):
    assert _dispatch.routed_tier(available, tier, head_dim, "bf16", kind, requested) == expected


@pytest.mark.parametrize("cc", [(7, 5), (7, 0), (6, 1)], ids=cc_id)
def test_old_gpu_rejected(cc):
    with pytest.raises(RuntimeError, match=rf"compute capability {cc[0]}\.{cc[1]} are not supported"):
        _dispatch.select_tier(cc)
    with pytest.raises(RuntimeError, match="not supported"):
        _dispatch.select_tier(cc, "sm80")


@pytest.mark.parametrize(
    "override, cc, expected",
    [("sm80", (8, 0), "sm80"), ("sm80", (9, 0), "sm80"), ("sm80", (12, 0), "sm80"), ("SM90", (9, 0), "sm90"),
     (" sm80 ", (10, 0), "sm80")],
    ids=lambda x: cc_id(x) if isinstance(x, tuple) else repr(x).strip("'").strip(),
)
def test_tier_override(override, cc, expected):
    assert _dispatch.select_tier(cc, override) == expected


@pytest.mark.parametrize("override, cc", [("sm90", (8, 0)), ("sm90", (10, 0)), ("sm90", (12, 0))],
                         ids=lambda x: cc_id(x) if isinstance(x, tuple) else x)
def test_tier_override_wrong_gpu(override, cc):
    with pytest.raises(RuntimeError, match=rf"tier {override} .* cannot run on this GPU of compute capability"):
        _dispatch.select_tier(cc, override)


@pytest.mark.parametrize("override", ["sm75", "hopper", "", "sm100"], ids=["sm75", "hopper", "empty", "sm100"])
def test_tier_override_unknown(override):
    """sm100 is not a tier until its kernels exist."""
    with pytest.raises(ValueError, match=r"unknown tier .*FLASH_ATTN_TIER.*expected one of: sm80, sm90$"):
        _dispatch.select_tier((9, 0), override)


def test_tier_override_from_environment(monkeypatch):
    monkeypatch.delenv("FLASH_ATTN_TIER", raising=False)
    assert _dispatch.requested_tier(None) is None
    monkeypatch.setenv("FLASH_ATTN_TIER", "")
    assert _dispatch.requested_tier(None) is None
    monkeypatch.setenv("FLASH_ATTN_TIER", "sm90")
    assert _dispatch.requested_tier(None) == "sm90"
    assert _dispatch.requested_tier("sm80") == "sm80"  # the argument wins


# ---------------------------------------------------------------------------------------------------------------
# Kernel lookup

BUILT = frozenset({key(80, "fwd", 64), key(80, "fwd", 128), key(80, "fwd", 128, "fp16")})


def test_kernel_available():
    _dispatch.check_kernel_available(BUILT, "sm80", 128, "bf16")
    _dispatch.check_kernel_available(BUILT, "sm80", 40, "bf16")  # runs on the 64 kernel
    _dispatch.check_kernel_available(BUILT, "sm80", 112, "fp16")  # runs on the 128 kernel


def test_kernel_missing_head_dim():
    with pytest.raises(RuntimeError, match=r"no sm80 fwd kernel for head dim 96 \(bf16\).*FLASH_ATTN_HEAD_DIMS"):
        _dispatch.check_kernel_available(BUILT, "sm80", 72, "bf16")
    with pytest.raises(RuntimeError, match=r"head dim 64 \(fp16\)"):
        _dispatch.check_kernel_available(BUILT, "sm80", 64, "fp16")
    with pytest.raises(RuntimeError, match=r"no sm80 bwd kernel for head dim 128"):
        _dispatch.check_kernel_available(BUILT, "sm80", 128, "bf16", "bwd")


def test_kernel_missing_tier():
    with pytest.raises(RuntimeError, match=r"tier sm90 is not built .*built tiers: sm80.*FLASH_ATTN_CUDA_ARCHS"):
        _dispatch.check_kernel_available(BUILT, "sm90", 128, "bf16")
    with pytest.raises(RuntimeError, match=r"built tiers: none"):
        _dispatch.check_kernel_available(frozenset(), "sm80", 128, "bf16")


@pytest.fixture
def fake_device(monkeypatch):
    """A GPU of compute capability 9.0 with the SM90 forward and the SM80 kernels built; counts capability lookups."""
    lookups = []

    def capability(index):
        lookups.append(index)
        return (9, 0)

    available = frozenset({key(90, "fwd", 128), key(80, "fwd", 128), key(80, "bwd", 128), key(80, "fwd", 64)})
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(_dispatch, "available_kernels", lambda: available)
    monkeypatch.delenv("FLASH_ATTN_TIER", raising=False)
    monkeypatch.setattr(_dispatch, "_resolved", {})
    return lookups


def test_resolve(fake_device):
    device = torch.device("cuda", 0)
    assert _dispatch.resolve(device, "fwd", 128, torch.bfloat16, None) == (90, 128)
    assert _dispatch.resolve(device, "fwd", 40, torch.bfloat16, None) == (80, 64)  # routed, padded up
    assert _dispatch.resolve(device, "bwd", 104, torch.bfloat16, None) == (80, 128)
    assert _dispatch.resolve(device, "fwd", 128, torch.bfloat16, "sm80") == (80, 128)
    assert _dispatch.resolve_tier(device, None, 128, torch.bfloat16, "bwd") == "sm80"


def test_resolve_is_cached_per_key(fake_device):
    """The device's capability and the routing are worked out once per (device, kind, head dim, dtype, override)."""
    device = torch.device("cuda", 0)
    for _ in range(3):
        _dispatch.resolve(device, "fwd", 128, torch.bfloat16, None)
    assert fake_device == [0]
    _dispatch.resolve(device, "bwd", 128, torch.bfloat16, None)
    assert fake_device == [0, 0]


def test_resolve_reads_the_override_on_every_call(fake_device, monkeypatch):
    device = torch.device("cuda", 0)
    assert _dispatch.resolve(device, "fwd", 128, torch.bfloat16, None) == (90, 128)
    monkeypatch.setenv("FLASH_ATTN_TIER", "sm80")
    assert _dispatch.resolve(device, "fwd", 128, torch.bfloat16, None) == (80, 128)


class CudaLike:
    """What _ops.autograd_route reads of q, as a bf16 CUDA tensor on device 0 would give it."""

    def __init__(self, head_dim):
        self.shape, self.dtype, self.device = (1, 1, 1, head_dim), torch.bfloat16, torch.device("cuda", 0)

    def get_device(self):
        return 0


def testautograd_route(fake_device, monkeypatch):
    """A differentiable eager call's two kernels, (forward's head dim, tier, backward's head dim, tier): worked out
    once per key, the override read on every call, and None for a backward the build lacks (its error comes at the
    backward)."""
    monkeypatch.setattr(_ops, "autograd_routes", {})
    for _ in range(2):
        assert _ops.autograd_route(CudaLike(128), None) == (128, 90, 128, 80)
    assert fake_device == [0, 0]  # the forward's and the backward's resolution, once
    monkeypatch.setenv("FLASH_ATTN_TIER", "sm80")
    assert _ops.autograd_route(CudaLike(128), None) == (128, 80, 128, 80)
    assert _ops.autograd_route(CudaLike(64), None) == (64, 80, None, None)


def test_resolve_errors_are_not_cached(fake_device, monkeypatch):
    device = torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="no sm90 bwd kernel for head dim 64"):
        _dispatch.resolve(device, "bwd", 64, torch.bfloat16, None)
    monkeypatch.setattr(_dispatch, "available_kernels", lambda: frozenset({key(80, "bwd", 64)}))
    assert _dispatch.resolve(device, "bwd", 64, torch.bfloat16, None) == (80, 64)
