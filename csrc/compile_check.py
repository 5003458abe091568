"""CI's compile check: compiles one kernel source per tier and kind of the catalog with nvcc for that tier's first arch,
and again for sm_90 where the tier runs there too (its code past __CUDA_ARCH__ 900: dependent launches, the decode
kernels' cluster merge), with no GPU needed, and prints the ptxas resource report (registers, spills, shared memory)."""
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_config  # noqa: E402
import generate_kernels  # noqa: E402

# The head dim most users run (or the kernel that serves it, for a kind compiled at one head dim); one file per tier
# and kind keeps CI inside its time budget.
CHECK_HEAD_DIM = 128


def sources_to_check() -> list:
    """One bf16 kernel source per tier and kind of the catalog."""
    catalog = generate_kernels.catalog
    return [src
            for tier_name, tier in catalog.TIERS.items()
            for kind_name, kind in tier.kinds.items()
            for src in generate_kernels.kernel_sources([tier_name], [kind_name],
                                                       [catalog.kernel_head_dim(CHECK_HEAD_DIM, kind)], ["bf16"])]


def compile_one(src, tier, arch: int) -> bool:
    """Compiles src for arch, printing its status and ptxas report; True if it compiled."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = build_config.nvcc_command(src.path, Path(tmp) / "k.o", [arch], None, tier.arch_suffix, tier.defines)
        t0 = time.time()
        res = subprocess.run(cmd, capture_output=True, text=True)
    report = [l for l in res.stderr.splitlines() if re.search(r"registers|spill|Compiling entry", l)]
    status = "ok" if res.returncode == 0 else "FAILED"
    print(f"{src.path.name} for sm_{arch}{tier.arch_suffix}: {status} in {time.time() - t0:.0f} s")
    print("\n".join("  " + l.strip() for l in report))
    if res.returncode != 0:
        print(res.stderr[-6000:])
    return res.returncode == 0


def main() -> int:
    failed = False
    for src in sources_to_check():
        tier = generate_kernels.catalog.TIERS[src.tier]
        for arch in dict.fromkeys([tier.archs[0]] + [90] * (90 in tier.archs)):
            failed |= not compile_one(src, tier, arch)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
