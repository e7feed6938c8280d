"""Native CPU kernels (C++ against torch's headers), compiled on first use and cached in the model cache."""

from .build import COMPILE_CHOICES, KernelBuildError, native_ops

__all__ = ["COMPILE_CHOICES", "KernelBuildError", "native_ops"]
