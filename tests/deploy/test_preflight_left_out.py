"""``medflare preflight KIT --job JOB`` with ``"class_map": {"cardiomegaly": null}`` (issue 61, item 2): the left-out
class's images are not read, by the site's checks nor by the job's (a folder of files no reader can decode passes),
and one WARN row counts them."""

from __future__ import annotations

import json
from pathlib import Path

from tests.deploy.test_preflight import NAMES, job_with, kit, preflight_lines, provisioned  # noqa: F401 (fixtures)

LEFT_OUT = 5


def test_a_left_out_class_is_not_read_by_preflight(kit: Path, tmp_path: Path, capsys) -> None:  # noqa: F811
    extra = tmp_path / "images" / "cardiomegaly"  # sorts first: the source's first image, were it read
    extra.mkdir()
    for index in range(LEFT_OUT):
        (extra / f"{index}.png").write_bytes(b"\x89PNG but not really")
    job = job_with(tmp_path, list(NAMES))
    site_file = kit / "local" / "medflare_site.json"
    content = json.loads(site_file.read_text())
    site_file.write_text(json.dumps({"data": {**content["data"], "class_map": {"cardiomegaly": None}}}))

    lines = preflight_lines(kit, job, capsys)

    assert not [line for line in lines if line.startswith("FAIL")], lines  # --no-server: nothing else fails
    assert any(line.startswith("PASS") and " images " in line and "all 24 images read" in line for line in lines), lines
    warn = [line for line in lines if " job classes " in line]
    assert len(warn) == 1 and warn[0].startswith("WARN") and warn[0].endswith(
        f"hospital-a: class_map leaves out cardiomegaly: {LEFT_OUT} image(s) neither trained nor checked (map a "
        "class to one of the job's names to train on it)"), lines
