"""The native CPU kernels: C sources in csrc/, built and bound in native_build.py and native.py."""
