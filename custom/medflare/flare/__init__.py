"""Thin NVIDIA FLARE adapters: executor, aggregator, controller, job export. No algorithm math here."""
