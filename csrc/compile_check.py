"""CI's compile check: compiles one kernel source per tier and kind of the catalog with nvcc for that tier's first arch
(no GPU needed) and prints the ptxas resource report (registers, spills, shared memory)."""
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


def main() -> int:
    failed = False
    for src in sources_to_check():
        tier = generate_kernels.catalog.TIERS[src.tier]
        arch = tier.archs[0]
        with tempfile.TemporaryDirectory() as tmp:
            cmd = build_config.nvcc_command(src.path, Path(tmp) / "k.o", [arch], None, tier.arch_suffix,
                                            tier.defines)
            t0 = time.time()
            res = subprocess.run(cmd, capture_output=True, text=True)
        report = [l for l in res.stderr.splitlines() if re.search(r"registers|spill|Compiling entry", l)]
        status = "ok" if res.returncode == 0 else "FAILED"
        print(f"{src.path.name} for sm_{arch}{tier.arch_suffix}: {status} in {time.time() - t0:.0f} s")
        print("\n".join("  " + l.strip() for l in report))
        if res.returncode != 0:
            print(res.stderr[-6000:])
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
