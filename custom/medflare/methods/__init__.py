"""Built-in methods, one import line each. A new one: `medflare new-method NAME` writes its folder and this line and
regenerates what the registry feeds (docs/architecture.md, "Adding a method")."""

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
    scaffold,
    ssl_fl,
)
