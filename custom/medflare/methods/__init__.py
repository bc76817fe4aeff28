"""Built-in methods. Adding a method = one folder plus one import line here."""

from medflare.methods import bsm_fl, fed_mas, fedavg, fedlc, fedprox, ldam_drw, local_only, moon  # noqa: F401
from medflare.methods import fca, fedbabu, fedrep, fedrs  # noqa: F401  (FCA and its personalized baselines)
from medflare.methods import fedmd, mdhfl  # noqa: F401
from medflare.methods import ssl_fl  # noqa: F401
from medflare.methods import fedavg_masked, fedlsm  # noqa: F401
