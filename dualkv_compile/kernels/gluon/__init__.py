"""Gluon kernels of shared-prompt attention for Hopper (sm_90): ``attention`` is the backend module."""
