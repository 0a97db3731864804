"""Memory profiling (per-step bytes by category, CUDA snapshots, traces) and NVTX ranges."""
