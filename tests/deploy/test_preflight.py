"""console/deploy/preflight.py: a hospital admin's check of a site before a job (issue 48, item 4).

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

from medflare.console.cli import main
from medflare.console.deploy.preflight import FAIL, PASS, WARN, preflight
from medflare.console.deploy.provision import provision

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
    assert main(["export", "fedavg", "-o", str(out), "--mode", "preinstalled",
                 "--set", f"task.num_classes={len(class_names)}",
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
    assert status == FAIL and "classes ['effusion', 'normal'] are not among the job's ['Effusion', 'Normal']" in detail
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


def test_every_reason_the_policy_refuses_a_job_for_is_named(kit: Path, tmp_path: Path) -> None:
    """Issue 61 minors: only the first refusal was named, so its author fixed one and was refused again."""
    site_file = kit / "local" / "medflare_site.json"
    policy = {"methods": ["fedprox"], "require": ["dp_sgd", "secure_aggregation"]}
    site_file.write_text(json.dumps({**json.loads(site_file.read_text()), "policy": policy}))
    checks = statuses(preflight(kit, job=job_with(tmp_path, list(NAMES)), progress=lambda line: None))
    assert checks["job policy"] == (FAIL, "the site would decline this job: method 'fedavg' is not among the methods "
                                          "this site accepts (fedprox); the job has no dp_sgd, secure_aggregation, "
                                          "which this site requires")


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
    # the other provisioning's CA has the same name (one project.yml): its signature is what does not hold
    assert status == FAIL and detail.startswith("client.crt is not signed by the kit's rootCA.pem (its signature "
                                                "does not verify); the kit was altered")
    assert "Error" not in detail  # issue 61 (minors): no exception class name for the admin to decode


def test_the_command_prints_json_and_exits_1_on_fail(kit: Path, capsys) -> None:
    assert main(["preflight", str(kit), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["overall"] == FAIL and report["checks"][0] == {
        "check": "kit files", "status": PASS, "detail": f"{kit.resolve()} (hospital-a)"}
    assert main(["preflight", str(kit.parent / "nowhere")]) == 1
    assert "is not a site's startup kit: startup/fed_client.json" in capsys.readouterr().out


# ----- issue 60, item 7: the kit's certificate and key, malformed kit files, the audit log -------------------------
def only_fail(checks: list) -> tuple[str, str]:
    """The one FAIL row of a report (the server nobody runs aside), as (check, detail)."""
    [row] = [(c.check, c.detail) for c in checks if c.status == FAIL and c.check != "server"]
    return row


@pytest.mark.parametrize("files, detail", [
    ({"client.crt": "hospital-b", "client.key": "hospital-b"},
     "client.crt is issued to hospital-b, not to this site hospital-a (fed_client.json)"),
    ({"client.key": "hospital-b"}, "client.key is not the key of client.crt (their public keys differ)"),
    ({"client.key": b"-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n"},
     "client.key is not an unencrypted PEM private key"),
    ({"client.key": "rootCA.pem"}, "client.key is not an unencrypted PEM private key"),
    ({"client.crt": b"not a certificate"}, "client.crt is not a PEM certificate"),
])
def test_a_certificate_and_key_that_are_not_this_sites_pair_fail(kit: Path, provisioned: Path, files: dict,
                                                                 detail: str) -> None:
    """Another site's certificate and key (signed by the same root), a key of another site, and a key file that
    is no key each give one FAIL row (preflight passed the first three)."""
    kits = provisioned / "medflare" / "prod_00"
    for name, source in files.items():
        content = source if isinstance(source, bytes) else (
            kit / "startup" / source if source == "rootCA.pem" else kits / source / "startup" / name).read_bytes()
        (kit / "startup" / name).write_bytes(content)
    check, found = only_fail(preflight(kit, progress=lambda line: None))
    assert check == "certificate" and found.startswith(detail), found


FED_CLIENTS = {  # what fed_client.json holds, and what its FAIL row says
    "a list": ("[]", "the top level is list, not an object"),
    "no client": ('{"servers": [{"service": {"target": "h:1"}}]}', "client is missing"),
    "no servers": ('{"client": {}}', "servers is missing"),
    "servers an object": ('{"servers": {"service": {}}, "client": {}}', "servers is dict, not a list"),
    "no server": ('{"servers": [], "client": {}}', "servers is empty"),
    "a target number": ('{"servers": [{"service": {"target": 8002}}], "client": {}}',
                        "servers[0].service.target is int, not a string"),
    "a target without port": ('{"servers": [{"service": {"target": "fl-server"}}], "client": {}}',
                              "servers[0].service.target is 'fl-server', not host:port"),
    "an fqsn number": ('{"servers": [{"service": {"target": "h:1"}}], "client": {"fqsn": 3}}',
                       "client.fqsn is int, not a string"),
    "not JSON": ('{"servers": [', "is not valid JSON"),
    "not UTF-8": ("\udcff", "cannot be read"),
}


@pytest.mark.parametrize("case", FED_CLIENTS)
def test_a_malformed_fed_client_json_is_one_fail_row(kit: Path, case: str) -> None:
    content, detail = FED_CLIENTS[case]
    (kit / "startup" / "fed_client.json").write_bytes(content.encode("utf-8", "surrogateescape"))
    [row] = preflight(kit, progress=lambda line: None)  # nothing else can be found without it
    assert (row.check, row.status) == ("kit files", FAIL) and detail in row.detail, row
    assert "\n" not in row.detail and "ask the project admin for this site's kit" in row.detail


def test_a_malformed_kit_versions_file_is_one_fail_row(kit: Path) -> None:
    (kit / "local" / "medflare_kit.json").write_text('["nvflare", "2.9.0"]')
    check, detail = only_fail(preflight(kit, progress=lambda line: None))
    assert check == "versions" and "the top level is list, not an object" in detail


def audit_log_of(kit: Path, lines: list[dict]) -> Path:
    """The kit's audit log as the site writes it (chained), one line per record of ``lines``."""
    from medflare.plan import resolve, validated
    from medflare.run_config import RunConfig
    from medflare.site_policy import AUDIT_FILE, AuditLog

    run = RunConfig(method="fedavg", data={"source": "site"}, task={"num_classes": 2, "in_channels": 1,
                                                                    "image_size": 28})
    plan = resolve(validated(run, check_files=False), "preinstalled")
    path = kit / "local" / AUDIT_FILE
    for line in lines:
        log = AuditLog(path, line["job"], plan)
        if "decided" in line:
            log.decided(line["decided"])
        if "epsilon" in line:
            log.task("train", 0, {"w": np.zeros(2)}, {"dp_epsilon": line["epsilon"]})
        if line.get("end"):
            log.close()
    return path


def with_dp_policy(kit: Path) -> None:
    site_file = kit / "local" / "medflare_site.json"
    site_file.write_text(json.dumps({**json.loads(site_file.read_text()), "policy": {"require": ["dp_sgd"]},
                                     "dp_sgd": {"max_epsilon": 8.0}}))


def test_an_intact_audit_log_passes_and_counts_a_killed_jobs_epsilon(kit: Path) -> None:
    with_dp_policy(kit)
    audit_log_of(kit, [{"job": "job-1", "decided": "accepted"}, {"job": "job-1", "epsilon": 0.5},
                       {"job": "job-1", "epsilon": 1.25, "end": True},
                       {"job": "job-2", "decided": "accepted"}, {"job": "job-2", "epsilon": 0.75}])  # killed
    checks = statuses(preflight(kit, progress=lambda line: None))
    assert checks["audit log"][0] == PASS and checks["audit log"][1].startswith(
        "medflare_audit.jsonl: 6 lines of 2 job(s), chain intact")
    # each job's last ε (cumulative within a job), the killed job's from its task line
    assert checks["DP-SGD"] == (PASS, "each job may spend ε ≤ 8; past jobs in the audit log spent ε 2 in all")


AUDIT_DAMAGE = {  # what is done to an intact 3-line log, and the start of the FAIL row after the file's name
    "a line edited": (lambda lines: [lines[0], lines[1].replace(b'"w": 16', b'"w": 0'), lines[2]],
                      "line 3 does not carry the hash of line 2"),
    "a line removed": (lambda lines: [lines[0], lines[2]], "line 2 does not carry the hash of line 1"),
    "a line that is not JSON": (lambda lines: [lines[0], b"}{", *lines[1:]], "line 2 is not JSON"),
    "a line that is a JSON list": (lambda lines: [*lines, b"[]"], "line 4 is a JSON list, not an object"),
    "a line that is a number": (lambda lines: [b"1e999", *lines], "line 1 is a JSON float, not an object"),
}


@pytest.mark.parametrize("case", AUDIT_DAMAGE)
def test_a_damaged_audit_log_is_one_fail_row_naming_its_first_broken_line(kit: Path, case: str) -> None:
    with_dp_policy(kit)  # the DP-SGD check read every line, and crashed on a list
    damage, detail = AUDIT_DAMAGE[case]
    path = audit_log_of(kit, [{"job": "job-1", "decided": "accepted"}, {"job": "job-1", "epsilon": 1.0},
                              {"job": "job-2", "decided": "accepted"}])
    path.write_bytes(b"\n".join(damage(path.read_bytes().splitlines())) + b"\n")
    checks = preflight(kit, progress=lambda line: None)
    check, found = only_fail(checks)
    assert check == "audit log" and found.startswith(f"{path} {detail}"), found
    assert statuses(checks)["DP-SGD"][0] == "WARN"  # what past jobs spent is unknown


@pytest.mark.parametrize("epsilon", [-1.0, float("nan"), float("inf")])
def test_an_audit_log_epsilon_no_accountant_reports_fails(kit: Path, epsilon: float) -> None:
    """Preflight reported "spent ε -1 in all" (or nan): a value no DP-SGD accountant gives is a FAIL row, even
    in a line whose chain holds."""
    with_dp_policy(kit)
    path = audit_log_of(kit, [{"job": "job-1", "decided": "accepted"}, {"job": "job-1", "epsilon": epsilon}])
    check, detail = only_fail(preflight(kit, progress=lambda line: None))
    assert check == "audit log" and detail.startswith(f"{path} line 2: dp_epsilon is {epsilon!r}, not a finite ε >= 0")


@pytest.mark.parametrize("audit_log", ["../elsewhere.jsonl", "/tmp/medflare_audit.jsonl"])
def test_an_audit_log_outside_local_fails(kit: Path, audit_log: str) -> None:
    site_file = kit / "local" / "medflare_site.json"
    site_file.write_text(json.dumps({**json.loads(site_file.read_text()), "policy": {"audit_log": audit_log}}))
    check, detail = only_fail(preflight(kit, progress=lambda line: None))
    assert check == "audit log" and detail.startswith(f"policy.audit_log '{audit_log}' is not a file inside")


# ----- issue 61, item 5: every key of the site file is one medflare reads -------------------------------------------
@pytest.mark.parametrize("edit, detail", [
    ({"polcy": {"require": ["robust"]}}, "unknown key 'polcy' (did you mean 'policy'?), which medflare would ignore"),
    ({"dp_sgdd": {"max_epsilon": 2.0}}, "unknown key 'dp_sgdd' (did you mean 'dp_sgd'?)"),
    ({"dp_sgd": {"max_epsilonn": 2.0}}, "medflare_site.json dp_sgd: unknown option(s) max_epsilonn (did you mean "
                                        "'max_epsilon'?); valid options: "),
    ({"distributed": {"procesess": 2}}, "medflare_site.json distributed: unknown option(s) procesess (did you mean "
                                        "'processes'?); valid options: backend, processes, shuffle_seed"),
    # issue 61 minors: every level, not only the top one
    ({"policy": {"requir": ["dp_sgd"]}}, "medflare_site.json policy: unknown option(s) requir (did you mean "
                                         "'require'?); valid options: approved_code, audit_log, methods, min_class_samples, require"),
    ({"data": {"windw": "lung"}}, "medflare_site.json data: unknown option(s) windw (did you mean 'window'?); valid "
                                  "options: augment, class_map,"),
])
def test_a_misspelt_key_of_the_site_file_is_one_fail_row_naming_it(kit: Path, edit: dict, detail: str) -> None:
    """A misspelt top-level key turned the site's policy (or DP-SGD budget) off with a PASS; a misspelt option of
    dp_sgd passed preflight and of distributed gave a TypeError. Now one FAIL row names the key and the valid ones."""
    site_file = kit / "local" / "medflare_site.json"
    content = json.loads(site_file.read_text())
    site_file.write_text(json.dumps({**content, **edit, "data": {**content["data"], **edit.get("data", {})}}))
    check, shown = only_fail(preflight(kit, progress=lambda line: None))
    assert detail in shown and "\n" not in shown, (check, shown)


def test_comment_keys_of_the_site_file_are_notes(kit: Path) -> None:
    site_file = kit / "local" / "medflare_site.json"
    data = json.loads(site_file.read_text())["data"]
    site_file.write_text(json.dumps({"_comment": "JSON has no comments", "_comment_data": "where the images are",
                                     "data": {**data, "_comment": "a note inside a section"},
                                     "policy": {"_comment": "who may train here", "min_class_samples": 0},
                                     "dp_sgd": {"_comment_budget": "none yet"}, "distributed": {"_comment": "one"}}))
    assert [c.check for c in preflight(kit, progress=lambda line: None) if c.status == FAIL] == ["server"]


# ----- issue 61, items 1 and 2: the job's classes are the contract; a site may hold a subset of them ---------------
def preflight_lines(kit: Path, job: Path, capsys) -> list[str]:
    """``medflare preflight KIT --job JOB --no-server`` as the admin runs it: the lines it prints."""
    capsys.readouterr()
    main(["preflight", str(kit), "--job", str(job), "--no-server"])
    return capsys.readouterr().out.splitlines()


def test_a_site_missing_one_of_the_jobs_classes_gets_a_warn_row_naming_it(kit: Path, tmp_path: Path,
                                                                          capsys) -> None:
    """Folders effusion/ and normal/ against a job of [cardiomegaly, effusion, normal]: it FAILed with "fix
    num_classes", which a site cannot do; now the job's data check passes and a WARN row names the missing class."""
    lines = preflight_lines(kit, job_with(tmp_path, ["cardiomegaly", "effusion", "normal"]), capsys)
    assert any(line.startswith("PASS") and "job data" in line and "16 train images fit the job's classes "
               "['cardiomegaly', 'effusion', 'normal']" in line for line in lines), lines
    warn = [line for line in lines if " job classes " in line]
    assert len(warn) == 1 and warn[0].startswith("WARN"), lines
    assert warn[0].endswith("hospital-a: this site holds no images of the job's class(es) cardiomegaly; it trains "
                            "on the others, numbered in the job's order (add images of them to contribute them)")


def test_class_map_null_leaves_an_extra_class_out_with_a_warn_row_counting_its_images(kit: Path, tmp_path: Path,
                                                                                      capsys) -> None:
    """An extra class folder is refused with the fix; ``"class_map": {"cardiomegaly": null}`` leaves its 5 images
    out (WARN), and the site's own classes row lists only the classes it keeps."""
    extra = tmp_path / "images" / "cardiomegaly"
    extra.mkdir()
    for index in range(5):
        Image.fromarray(np.zeros((28, 28), dtype=np.uint8)).save(extra / f"{index}.png")
    job = job_with(tmp_path, list(NAMES))
    refused = [line for line in preflight_lines(kit, job, capsys) if "job data" in line]
    assert len(refused) == 1 and refused[0].startswith("FAIL") and "not among the job's ['effusion', 'normal']" in \
        refused[0] and '{"cardiomegaly": null}' in refused[0], refused

    site_file = kit / "local" / "medflare_site.json"
    content = json.loads(site_file.read_text())
    content["data"]["class_map"] = {"cardiomegaly": None}
    site_file.write_text(json.dumps(content))
    lines = preflight_lines(kit, job, capsys)
    assert [line.split(None, 1)[0] for line in lines if " job data " in line] == ["PASS"], lines
    warn = [line for line in lines if " job classes " in line]
    assert len(warn) == 1 and warn[0].startswith("WARN") and "class_map leaves out cardiomegaly: 5 image(s) " \
        "neither trained nor checked" in warn[0], lines
    assert any("2 classes (train/val/test): effusion 8/2/2; normal 8/2/2" in line for line in lines), lines


def test_a_job_with_the_placeholder_class_names_is_refused_saying_how_to_name_them(kit: Path, tmp_path: Path,
                                                                                   capsys) -> None:
    out = tmp_path / "jobs"
    assert main(["export", "fedavg", "-o", str(out), "--mode", "preinstalled", "--set", "task.num_classes=2",
                 "--set", "task.in_channels=1", "--set", "task.image_size=28"]) == 0
    refused = [line for line in preflight_lines(kit, out / "fedavg", capsys) if " job data " in line]
    assert len(refused) == 1 and refused[0].startswith("FAIL"), refused
    assert "the job's class names are the placeholder ['<class 1>', '<class 2>']; the lead sets them" in refused[0]


# ----- issue 61 minors: the image rows say what a site sees ---------------------------------------------------------
def test_a_12_bit_tiff_site_sees_its_raw_range_and_what_it_is_scaled_to(kit: Path, tmp_path: Path) -> None:
    images = tmp_path / "tiff"
    for name in NAMES:
        (images / name).mkdir(parents=True)
        for index in range(12):
            pixels = np.full((28, 28), 100 * index, dtype=np.uint16)
            pixels[0, 0], pixels[-1, -1] = 7, 4095 if index == 3 else 300  # 12 bits: 0 to 4095
            Image.fromarray(pixels).save(images / name / f"{index}.tif")
    (kit / "local" / "medflare_site.json").write_text(json.dumps({"data": {"source": f"folder:{images}"}}))
    status, detail = statuses(preflight(kit, progress=lambda line: None))["intensities"]
    assert (status, detail) == (PASS, "scaled to [0, 1]; raw 0 to 4095, scaled to 0 to 1")


def test_mixed_image_sizes_warn_with_what_the_site_can_do(kit: Path, tmp_path: Path) -> None:
    images = tmp_path / "mixed"
    for name in NAMES:
        (images / name).mkdir(parents=True)
        for index in range(12):
            Image.fromarray(np.zeros((28, 28 + index % 2 * 4), dtype=np.uint8)).save(images / name / f"{index}.png")
    (kit / "local" / "medflare_site.json").write_text(json.dumps({"data": {"source": f"folder:{images}"}}))
    status, detail = statuses(preflight(kit, progress=lambda line: None))["image sizes"]
    assert status == "WARN" and detail.endswith(
        "every job resizes them to its own square image size, stretching non-square ones (to keep their aspect "
        "ratio, crop or pad the images to squares)") and "data.image_size" not in detail


def test_a_folder_mixing_colour_and_grey_images_warns_with_what_it_is_read_as(kit: Path, tmp_path: Path) -> None:
    """Issue 61 minors: the channel count came from the first file, without a word."""
    images = tmp_path / "mixed-colour"
    for name in NAMES:
        (images / name).mkdir(parents=True)
        for index in range(12):
            shape = (28, 28, 3) if index % 2 else (28, 28)  # 0.png, the first file, is grey
            Image.fromarray(np.zeros(shape, dtype=np.uint8)).save(images / name / f"{index}.png")
    (kit / "local" / "medflare_site.json").write_text(json.dumps({"data": {"source": f"folder:{images}"}}))
    checks = statuses(preflight(kit, progress=lambda line: None))
    status, detail = checks["image channels"]
    assert status == "WARN" and detail.startswith("the images mix colour and grey files (") and detail.endswith(
        "all are read as 1-channel, as the first file is (colour ones converted to grey); to choose, convert them "
        "all to one kind"), detail


def test_one_kind_of_image_has_no_channel_row(kit: Path) -> None:
    assert "image channels" not in statuses(preflight(kit, progress=lambda line: None))


# ----- the platform and the job's code (issue 64) ------------------------------------------------------------------
def byoc_job(tmp_path: Path) -> Path:
    out = tmp_path / "byoc-jobs"
    assert main(["export", "fedavg", "-o", str(out), "--mode", "byoc", "--set", "task.num_classes=2",
                 "--set", "task.in_channels=1", "--set", "task.image_size=28",
                 "--set", f"task.class_names={json.dumps(list(NAMES))}"]) == 0
    return out / "fedavg"


def with_policy(kit: Path, policy: dict) -> None:
    site_file = kit / "local" / "medflare_site.json"
    site_file.write_text(json.dumps({**json.loads(site_file.read_text()), "policy": policy}))


@pytest.mark.parametrize("faked", ["installed", "kit"])
def test_a_flare_below_the_advisory_floor_is_a_fail_naming_the_cves(kit: Path, monkeypatch, faked: str) -> None:
    from medflare.console.deploy.policies import KIT_VERSIONS_FILE

    if faked == "installed":  # what this machine runs
        monkeypatch.setattr("medflare.advisories.installed_nvflare", lambda: "2.7.1")
    else:  # what the kit was set up with
        recorded = kit / "local" / KIT_VERSIONS_FILE
        recorded.write_text(json.dumps({**json.loads(recorded.read_text()), "nvflare": "2.6.2"}))
    status, detail = statuses(preflight(kit, progress=lambda line: None))["platform"]
    assert status == FAIL and "below 2.7.2" in detail
    assert all(cve in detail for cve in ("CVE-2026-24178", "CVE-2026-24186", "CVE-2026-24204"))
    assert statuses(preflight(kit, progress=lambda line: None))["platform"][0] == FAIL


def test_the_pinned_flare_passes_the_platform_check(kit: Path) -> None:
    assert statuses(preflight(kit, progress=lambda line: None))["platform"][0] == PASS


def test_a_job_exported_with_another_flare_is_a_warn(kit: Path, tmp_path: Path, monkeypatch) -> None:
    job = job_with(tmp_path, list(NAMES))
    assert statuses(preflight(kit, job=job, progress=lambda line: None))["job platform"][0] == PASS
    monkeypatch.setattr("medflare.advisories.installed_nvflare", lambda: "2.9.1")
    status, detail = statuses(preflight(kit, job=job, progress=lambda line: None))["job platform"]
    assert (status, detail) == (WARN, "this site runs nvflare 2.9.1, the job was exported with 2.9.0; medflare was "
                                      "tested with the job's")


def test_preflight_shows_the_jobs_code_digest_and_the_policys_verdict(kit: Path, tmp_path: Path, capsys) -> None:
    from medflare.console.job_export import job_code_digest

    job = byoc_job(tmp_path)
    digest = job_code_digest(job)
    assert f"code digest: {digest}" in capsys.readouterr().out  # export prints what the lead sends the sites
    assert statuses(preflight(kit, job=job, progress=lambda line: None))["job code"] == (
        PASS, f"{digest}: any code is accepted (policy.approved_code is not set)")
    with_policy(kit, {"approved_code": [digest]})
    assert statuses(preflight(kit, job=job, progress=lambda line: None))["job code"] == (
        PASS, f"{digest}: approved by this site's policy")
    with_policy(kit, {"approved_code": ["sha256:" + "0" * 64]})
    status, detail = statuses(preflight(kit, job=job, progress=lambda line: None))["job code"]
    assert status == FAIL and detail.startswith(f"the site would decline this job: the job brings code {digest}")
    with_policy(kit, {})  # the code edited after export: the digest found is not the one recorded
    plan_module = job / "app" / "custom" / "medflare" / "plan.py"
    plan_module.write_text(plan_module.read_text() + "\n")
    status, detail = statuses(preflight(kit, job=job, progress=lambda line: None))["job code"]
    assert status == WARN and f"its export recorded {digest} (the code changed since)" in detail
    preinstalled = job_with(tmp_path, list(NAMES))
    with_policy(kit, {"approved_code": []})
    assert statuses(preflight(kit, job=preinstalled, progress=lambda line: None))["job code"] == (
        PASS, "preinstalled: pre-installed code: runs this site's own installation")
