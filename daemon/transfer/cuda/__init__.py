"""The GPU side of transfers: CUDA IPC memory and the copy executor."""
