"""jaxshard: transformer training on named device meshes.

Parallelism is a choice of which mesh axis shards which array; XLA's SPMD partitioner
inserts the collectives. See DESIGN notes in the README.
"""

__version__ = "0.1.0"
