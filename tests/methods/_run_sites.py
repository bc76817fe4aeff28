"""A site of a default job, built the way a run builds it (RunConfig -> plan -> the site's settings -> SiteRuntime),
for the seam tests (not collected: no ``test_`` prefix)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from medflare.plan import resolve
from medflare.run_config import RunConfig
from medflare.site_config import SiteFile
from medflare.site_runtime import SiteRuntime

SOURCE = "synthetic:n=160,classes=4,size=8,n_val=40,n_test=80"


def default_job_site(method: str, site: str = "site-1", partition: str = "dirichlet:0.3",
                     local_dir: Path | None = None, **options: Any) -> SiteRuntime:
    """``site`` of a two-site simulated job of ``method`` with nothing but the data, model and ``options`` set
    (``local_dir``: the site's job workspace, where it keeps its state)."""
    run = RunConfig(method=method, rounds=2, clients=2, model="cnn",
                    data={"source": SOURCE, "partition": partition, "min_size": 5}, **options)
    settings, index = resolve(run).localise(site, SiteFile(Path("."), None), simulated=True)
    return SiteRuntime(settings, site, index, log=lambda message: None, local_dir=local_dir)
