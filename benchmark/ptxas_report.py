"""Registers, stack and spills of every kernel in the build's ptxas logs (build/kernels/*.log), one line per kernel
and arch, keyed by the generated file it came from and the tile's template arguments."""

import re
import sys
from pathlib import Path

ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\w+)'\s*\n[^\n]*Function properties[^\n]*\n"
                   r"\s*(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads\s*\n"
                   r"[^\n]*Used (\d+) registers")
KERNEL = re.compile(r"\d([a-z_]+_kernel)I")
# The traits' template arguments up to the element type: the head dim, then the tile's fields (a class-type template
# argument, mangled as its literals).
TRAITS = re.compile(r"(Fwd|Bwd)TraitsI(.*?)N7cutlass")


def main():
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "build/kernels")
    for log in sorted(folder.glob("*.log")):
        for name, arch, stack, spill_st, spill_ld, regs in ENTRY.findall(log.read_text()):
            kernel = KERNEL.search(name)
            traits = TRAITS.search(name)
            tile = "x".join(re.findall(r"Li(\d+)E", traits.group(2))) if traits else "-"
            print(f"{log.stem:28s} {kernel.group(1) if kernel else name:24s} {tile:22s} {arch:7s} regs={regs:3s} "
                  f"stack={stack} spill={spill_st}/{spill_ld}")


if __name__ == "__main__":
    main()
