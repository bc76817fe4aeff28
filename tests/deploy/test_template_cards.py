"""Each template card (info.md) gives the site policies' actual rule: the exact component paths the template
names, every one of them on the allow-list medflare's provisioning writes, and never a package prefix."""

from __future__ import annotations

import re

import pytest
from pyhocon import ConfigFactory

from job_templates import TEMPLATES_DIR
from medflare.console.deploy.policies import CLIENT_COMPONENTS, SERVER_COMPONENTS
from medflare.registry import list_methods

CONFIG_FILES = ("config_fed_server.conf", "config_fed_client.conf")


def hocon_paths(value: object) -> set[str]:
    """Every component ``path`` in a parsed config."""
    if isinstance(value, dict):
        own = {value["path"]} if isinstance(value.get("path"), str) else set()
        return own.union(*(hocon_paths(item) for item in value.values()))
    if isinstance(value, list):
        return set().union(*(hocon_paths(item) for item in value))
    return set()


@pytest.mark.parametrize("method", list_methods())
def test_card_lists_exactly_the_allow_listed_paths_its_configs_name(method: str) -> None:
    folder = TEMPLATES_DIR / method
    named = set().union(*(hocon_paths(ConfigFactory.parse_file(str(folder / name)).as_plain_ordered_dict())
                          for name in CONFIG_FILES))
    card = (folder / "info.md").read_text()
    listed = set(re.findall(r"^- `([\w.]+)`$", card, flags=re.MULTILINE))
    assert listed == named
    assert listed <= set(SERVER_COMPONENTS) | set(CLIENT_COMPONENTS)  # what provisioning allow-lists, exactly
    prose = " ".join(card.split())
    assert "allow-lists each component path exactly, never a package prefix" in prose
    assert "one prefix" not in prose
