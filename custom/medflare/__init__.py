"""medflare: federated medical image classification on NVIDIA FLARE."""

__version__ = "0.1.0"
