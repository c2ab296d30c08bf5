"""tokenmill's Triton kernels (CUDA): paged attention (attention.py). Imported only where triton is installed."""
