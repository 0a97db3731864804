"""Model parallelism: the world's ranks as pipeline stages x data-parallel replicas (pipeline.py)."""
