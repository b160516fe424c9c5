"""Kernels the SPMD partitioner cannot express alone, as explicit ``shard_map`` collectives.

Each reads the active sharding rules: with the relevant mesh axis of size 1 (or no rules) it
is the plain single-device computation, so model code calls it unconditionally.
"""
