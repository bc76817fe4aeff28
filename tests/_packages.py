"""An "installed" package for tests: a module and a ``.dist-info`` folder with entry points, on ``sys.path``.

importlib.metadata finds a distribution by its ``*.dist-info`` folder on ``sys.path``, exactly as after
``pip install``, so the registries' entry-point lookup is exercised without installing anything.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from medflare.installed import forget_installed


@contextmanager
def installed_package(
    root: Path, name: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str]
) -> Iterator[Path]:
    """Make ``root`` hold distribution ``name`` (version 0.1) with ``entry_points`` ({group: {name: value}}) and
    the top-level ``modules`` ({module name: source}); on ``sys.path`` while the context lasts.

    The registries rescan entry points on entry and exit, and the modules are dropped from ``sys.modules``
    afterwards, so nothing leaks into other tests.
    """
    dist_info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    sections = [f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in entries.items())
                for group, entries in entry_points.items()]
    (dist_info / "entry_points.txt").write_text("\n".join(sections))
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)
    sys.path.insert(0, str(root))
    forget_installed()
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        for module in modules:
            sys.modules.pop(module, None)
        forget_installed()
