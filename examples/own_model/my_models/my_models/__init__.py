"""Example package: a user's own networks for medflare, found through the ``medflare.models`` entry point."""
