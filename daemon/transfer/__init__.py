"""Page transfers between engine memory and the host pool (CPU and CUDA)."""
