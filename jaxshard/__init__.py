"""jaxshard: transformer training on named device meshes.

Parallelism is a choice of which mesh axis shards which array; XLA's SPMD partitioner
inserts the collectives. The README explains the strategies, the tools and their tests.
"""

__version__ = "0.1.0"
