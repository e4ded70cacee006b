"""A reproducible, torchrun-compatible PyTorch training stack.

Importing this package does no work: no I/O, no environment reads, no torch import.
"""

__version__ = "0.1.0"
