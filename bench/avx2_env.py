"""Shell exports that make this process tree compute as on a CPU without AVX-512 (AVX2 only):
numba compiles the kernels for AMD Zen 2 with every AVX-512 feature off, numpy and torch
dispatch no AVX-512 code. On an AVX-512 host this measures what the kernels cost on the AVX2
machines many hosts still are (the hashing and the copies are the same on both).

    eval "$(.venv/bin/python bench/avx2_env.py)"; .venv/bin/python bench/run.py ...
"""

from __future__ import annotations

import llvmlite.binding as llvm

NUMPY_AVX512 = "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"


def main() -> None:
    host = llvm.get_host_cpu_features()
    features = ",".join(
        ("-" if name.startswith(("avx512", "avx10", "evex512", "amx")) or not on else "+") + name
        for name, on in host.items()
    )
    print(
        f"export NUMBA_CPU_NAME=znver2 NUMBA_CPU_FEATURES={features} "
        f"NPY_DISABLE_CPU_FEATURES='{NUMPY_AVX512}' ATEN_CPU_CAPABILITY=avx2"
    )


if __name__ == "__main__":
    main()
