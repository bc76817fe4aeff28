"""Built-in methods. Adding a method = one folder plus one import line here."""

from medflare.methods import bsm_fl, fedavg, fedprox  # noqa: F401
