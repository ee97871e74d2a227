"""Triton kernels only: ``@triton.jit`` functions, no torch calls.

primitives: peer pointers, release signals, bounded acquire waits (used by all the others);
route: the dispatch layout; dispatch: the token move and expansion; combine: the reduction back.
"""
