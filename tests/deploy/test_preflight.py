"""deploy/preflight.py: a hospital admin's check of a site before a job (issue 48, item 4).

A kit provisioned from provisioning/project.yml (its server pointed at a loopback port nothing listens on; the
POC test checks a reachable server), a folder of PNGs as the site's data, and a job exported as the lead does.
"""

from __future__ import annotations

import datetime
import json
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medflare.cli import main
from medflare.deploy.preflight import FAIL, PASS, preflight
from medflare.deploy.provision import provision

REPO = Path(__file__).resolve().parents[2]
NAMES = ("effusion", "normal")


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory) -> Path:
    """The project's workspace (its CA's state) after one provisioning."""
    workspace = tmp_path_factory.mktemp("preflight")
    provision(REPO / "provisioning" / "project.yml", workspace / "ws")
    return workspace / "ws"


@pytest.fixture
def kit(provisioned: Path, tmp_path: Path) -> Path:
    """hospital-a's kit with its own images (28x28 PNGs of two classes) in local/medflare_site.json."""
    kit = tmp_path / "hospital-a"
    shutil.copytree(provisioned / "medflare" / "prod_00" / "hospital-a", kit)
    images = tmp_path / "images"
    rng = np.random.default_rng(0)
    for name in NAMES:
        (images / name).mkdir(parents=True)
        for index in range(12):
            Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(images / name / f"{index}.png")
    (kit / "local" / "medflare_site.json").write_text(json.dumps({"data": {"source": f"folder:{images}"}}))
    fed_client = kit / "startup" / "fed_client.json"
    config = json.loads(fed_client.read_text())
    config["servers"][0]["service"]["target"] = f"127.0.0.1:{closed_port()}"
    fed_client.write_text(json.dumps(config))
    return kit


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # free once the socket closes: nothing listens there


def statuses(checks: list) -> dict[str, tuple[str, str]]:
    return {check.check: (check.status, check.detail) for check in checks}


def job_with(tmp_path: Path, class_names: list[str]) -> Path:
    out = tmp_path / "jobs"
    assert main(["export", "fedavg", "-o", str(out), "--mode", "preinstalled", "--set", "task.num_classes=2",
                 "--set", "task.in_channels=1", "--set", "task.image_size=28",
                 "--set", f"task.class_names={json.dumps(class_names)}"]) == 0
    return out / "fedavg"


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_good_site_passes_all_but_the_server_nobody_runs_and_preflight_writes_nothing(
    kit: Path, tmp_path: Path
) -> None:
    job = job_with(tmp_path, list(NAMES))
    before = tree(tmp_path)
    checks = statuses(preflight(kit, job=job, progress=lambda line: None))
    assert tree(tmp_path) == before
    status, detail = checks.pop("server")
    assert status == FAIL and detail.startswith("nothing answers at 127.0.0.1:")  # the unreachable server
    checks.pop("disk")  # PASS or WARN with the free space of this machine
    assert {name: status for name, (status, _) in checks.items()} == dict.fromkeys(checks, PASS), checks
    assert checks["classes"][1] == "2 classes (train/val/test): effusion 8/2/2; normal 8/2/2"
    assert checks["images"][1] == "all 24 images read" and checks["image sizes"][1] == "28x28 (24)"
    assert checks["certificate"][1].startswith("O=hospital_a,CN=hospital-a, issued by CN=medflare")


def test_a_missing_data_path_fails(kit: Path) -> None:
    (kit / "local" / "medflare_site.json").write_text(json.dumps({"data": {"source": "folder:/no/such/images"}}))
    status, detail = statuses(preflight(kit, progress=lambda line: None))["data"]
    assert status == FAIL and "'/no/such/images' does not exist" in detail


def test_a_corrupt_image_fails_naming_the_file(kit: Path, tmp_path: Path) -> None:
    broken = tmp_path / "images" / "normal" / "broken.png"
    broken.write_bytes(b"\x89PNG but not really")
    status, detail = statuses(preflight(kit, progress=lambda line: None))["images"]
    assert (status, detail) == (FAIL, f"1 of 25 images cannot be read: {broken}; replace or remove them")


def test_a_class_name_mismatch_with_the_job_fails_and_class_map_fixes_it(kit: Path, tmp_path: Path) -> None:
    job = job_with(tmp_path, ["Effusion", "Normal"])
    status, detail = statuses(preflight(kit, job=job, progress=lambda line: None))["job data"]
    assert status == FAIL and "classes ['effusion', 'normal'] are not the job's ['Effusion', 'Normal']" in detail
    site_file = kit / "local" / "medflare_site.json"
    content = json.loads(site_file.read_text())
    content["data"]["class_map"] = {"effusion": "Effusion", "normal": "Normal"}
    site_file.write_text(json.dumps(content))
    assert statuses(preflight(kit, job=job, progress=lambda line: None))["job data"][0] == PASS


def test_a_policy_that_refuses_the_job_fails(kit: Path, tmp_path: Path) -> None:
    site_file = kit / "local" / "medflare_site.json"
    site_file.write_text(json.dumps({**json.loads(site_file.read_text()), "policy": {"require": ["dp_sgd"]}}))
    checks = statuses(preflight(kit, job=job_with(tmp_path, list(NAMES)), progress=lambda line: None))
    assert checks["job policy"] == (FAIL, "the site would decline this job: the job has no dp_sgd, which this site "
                                          "requires")


def test_an_expired_certificate_fails(kit: Path, provisioned: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    state = json.loads((provisioned / "medflare" / "state" / "cert.json").read_text())
    ca_key = serialization.load_pem_private_key(state["root_pri_key"].encode(), password=None)
    current = x509.load_pem_x509_certificate((kit / "startup" / "client.crt").read_bytes())
    now = datetime.datetime.now(datetime.timezone.utc)
    expired = (x509.CertificateBuilder().subject_name(current.subject).issuer_name(current.issuer)
               .public_key(current.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(days=400)).not_valid_after(now - datetime.timedelta(days=2))
               .sign(ca_key, hashes.SHA256()))  # the consortium's CA signed it: only its dates are wrong
    (kit / "startup" / "client.crt").write_bytes(expired.public_bytes(serialization.Encoding.PEM))
    status, detail = statuses(preflight(kit, progress=lambda line: None))["certificate"]
    assert status == FAIL and detail.startswith(f"client.crt expired on {expired.not_valid_after_utc:%Y-%m-%d} UTC")


def test_a_certificate_from_another_consortium_fails(kit: Path, provisioned: Path) -> None:
    other = provisioned.parent / "other-ca.pem"
    if not other.exists():  # one CA of another provisioning, made once
        provision(REPO / "provisioning" / "project.yml", provisioned.parent / "other")
        shutil.copy(provisioned.parent / "other" / "medflare" / "prod_00" / "hospital-a" / "startup" / "rootCA.pem",
                    other)
    shutil.copy(other, kit / "startup" / "rootCA.pem")
    status, detail = statuses(preflight(kit, progress=lambda line: None))["certificate"]
    assert status == FAIL and detail.startswith("client.crt is not signed by the kit's rootCA.pem")


def test_the_command_prints_json_and_exits_1_on_fail(kit: Path, capsys) -> None:
    assert main(["preflight", str(kit), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["overall"] == FAIL and report["checks"][0] == {
        "check": "kit files", "status": PASS, "detail": f"{kit.resolve()} (hospital-a)"}
    assert main(["preflight", str(kit.parent / "nowhere")]) == 1
    assert "is not a site's startup kit: startup/fed_client.json" in capsys.readouterr().out
