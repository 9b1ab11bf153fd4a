"""Triton kernels (installed as ``splash.kernels_triton``)."""
