"""Built-in methods. Adding a method = one folder plus one import line here."""

from medflare.methods import (  # noqa: F401
    bsm_fl,
    fca,
    fed_mas,
    fedavg,
    fedavg_masked,
    fedbabu,
    fedlc,
    fedlsm,
    fedmd,
    fedprox,
    fedrep,
    fedrs,
    ldam_drw,
    local_only,
    mdhfl,
    moon,
    ssl_fl,
)
