"""medflare's FedAvg workload as a Flower App (ServerApp + ClientApp), for ``benchmarks/peer_flower.py``."""
