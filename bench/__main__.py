"""Run every benchmark module in this package, in name order, printing figures and ratios.

Targets are goals printed beside the measured figures, never assertions: these machines are
shared and noisy (see README).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time

import bench


def main() -> int:
    only = set(sys.argv[1:])
    modules = pkgutil.iter_modules(bench.__path__)
    names = sorted(m.name for m in modules if m.name.startswith("bench_"))
    for name in names:
        if only and name not in only and name.removeprefix("bench_") not in only:
            continue
        module = importlib.import_module(f"bench.{name}")
        print(f"== {name} ==", flush=True)
        started = time.perf_counter()
        module.main()
        print(f"   ({time.perf_counter() - started:.1f} s)\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
