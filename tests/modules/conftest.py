"""Shared fixtures of the module tests: the Triton kernels under Triton's interpreter.

``triton.jit`` decides at import time whether a kernel compiles for a GPU or runs in the
interpreter (``TRITON_INTERPRET=1``), so `interpreted_kernels` imports fresh copies of the kernel
modules with that variable set, keeps it set while the test launches them (Triton checks it again
at launch), and puts the package's own modules back afterwards. The interpreter runs the kernels
on CPU tensors with numpy's float32 arithmetic; the kernels' software conversions (bfloat16, FP8)
take the place of the GPU's conversion instructions there (see ``_fp8_cast_triton._fp8_bits``).
"""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest

KERNEL_MODULES = ("zbpp.modules._fp8_cast_triton", "zbpp.modules._fused_triton")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "interpreter: runs Triton kernels in Triton's interpreter on the CPU (seconds)"
    )


@pytest.fixture
def interpreted_kernels(monkeypatch):
    """``.cast`` and ``.fused``: the kernel modules as the Triton interpreter runs them."""
    pytest.importorskip("triton", reason="the interpreter tests need Triton installed")
    import zbpp.modules as package

    saved = {name: sys.modules.pop(name, None) for name in KERNEL_MODULES}
    attrs = {name.rsplit(".", 1)[1]: getattr(package, name.rsplit(".", 1)[1], None)
             for name in KERNEL_MODULES}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        cast, fused = (importlib.import_module(name) for name in KERNEL_MODULES)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        for attr, module in attrs.items():
            if module is None:
                if hasattr(package, attr):
                    delattr(package, attr)
            else:
                setattr(package, attr, module)
    if not bool(cast.INTERPRETED):
        pytest.skip("this Triton does not pick its interpreter from TRITON_INTERPRET")
    return SimpleNamespace(cast=cast, fused=fused)


# The fused kernels' interpreter fallbacks agree with the compiled kernels from Triton 3.8 on; Triton
# 3.6's interpreter raises under numpy 2.4 and differs in signed zeros under older numpy
FUSED_INTERPRETER_TRITON = (3, 8)


@pytest.fixture
def interpreted_fused_kernels(interpreted_kernels):
    """`interpreted_kernels`, for the fused kernels: skipped on a Triton whose interpreter runs
    them unlike its compiler (the GPU tests check them compiled there)."""
    import triton

    version = tuple(int(v) for v in triton.__version__.split("+")[0].split(".")[:2])
    if version < FUSED_INTERPRETER_TRITON:
        pytest.skip(f"Triton {triton.__version__}'s interpreter runs the fused FP8 kernels unlike its compiler "
                    "(3.6: TypeErrors under numpy 2.4, signed zeros otherwise); -m gpu checks them compiled")
    return interpreted_kernels
