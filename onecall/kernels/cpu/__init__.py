"""The native CPU kernels: C sources in csrc/ (csrc/kernels.h declares every export and struct),
built by native_build.py, bound from the header by native_abi.py (struct layouts checked against the
compiler's at load: csrc/layout.c), called through native.py."""
