"""``medflare preflight``: a hospital admin's check of a site, on the site machine, before a job arrives.

It checks the kit (files and the shape of ``fed_client.json``; the certificate's root, dates and site name, and its
key; the server's name resolving and answering FLARE's own connectivity check), ``local/medflare_site.json``
(schema, policy, paths), the site's audit log (its hash chain, its ε values), every image (corrupt files, counts per
class, sizes, intensity ranges), disk space, devices, the installed versions against the kit's and against FLARE's
known advisories (:mod:`medflare.advisories`), and the DP-SGD budget; with ``--job``, the site's data and policy
against that job, the digest of the code it brings against the policy's approved code and its FLARE release, with
the functions the site runs when the job arrives (``RunPlan.localise``, ``site_runtime.load_site_data``,
``SitePolicy.refusal`` and ``code_refusal``). Every check gives PASS,
WARN or FAIL with one line of detail; nothing is written but the report (stdout).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from medflare import readback
from medflare.contracts import DP_EPSILON
from medflare.errors import DataError, MedflareError

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
CERT_WARN_DAYS = 30  # a certificate that expires sooner gets a WARN: re-provisioning takes the consortium time
DISK_FAIL_GIB, DISK_WARN_GIB = 1.0, 10.0  # free space where the kit's jobs write (models, checkpoints, logs)
PROGRESS_SECONDS = 5.0  # how often the image scan says how far it is
KIT_FILES = ("startup/fed_client.json", "startup/client.crt", "startup/client.key", "startup/rootCA.pem", "local")
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    check: str
    status: str  # PASS | WARN | FAIL
    detail: str


class Failed(Exception):
    """A check that cannot go on (its FAIL line); the later checks that need it are skipped."""


def preflight(kit: str | Path, job: str | Path | None = None, max_images: int = 0, server: bool = True,
              progress: Progress = lambda line: print(line, file=sys.stderr, flush=True)) -> list[Check]:
    """Every check of the site whose kit is ``kit`` (and, with ``job``, of that job at this site). ``max_images``:
    read at most this many images per split (0: every image). ``server``: False leaves the server unchecked (a WARN
    line), for a site set up before the consortium's server runs."""
    kit = Path(kit).resolve()
    checks: list[Check] = []
    client = _run_value(checks, "kit files", _kit_files, kit)
    if client is None:  # no kit: nothing else can be found
        return checks
    checks.append(_run("certificate", _certificate, kit, client))
    checks.append(_run("server", _server, kit, client) if server else
                  Check("server", WARN, "not checked (--no-server)"))
    checks += [_run("versions", _versions, kit), _run("platform", _platform, kit), _run("disk", _disk, kit)]
    site = client.site
    site_file = _run_value(checks, "site file", _site_file, kit)
    policy = _run_value(checks, "policy", _policy, site_file) if site_file is not None else None
    if policy is not None:
        audit = _run_value(checks, "audit log", _audit_log, site_file, policy)
        found = _run_value(checks, "data", _site_data, site, site_file)
        if found is not None:
            checks += _image_checks(*found, policy.min_class_samples, max_images, progress)
            checks.append(_run("patients", _patient_check, found[0], site_file))
        checks.append(_run("DP-SGD", _dp_budget, site_file, policy, audit))
        checks.append(_run("devices", _devices, site_file))
        if job is not None:
            checks += _job_checks(Path(job), site, site_file, policy)
    return checks


def _run(name: str, check: Callable[..., tuple[str, str]], *args: Any) -> Check:
    """``check(*args)`` returns (status, detail); a medflare error or :class:`Failed` is its FAIL line."""
    try:
        status, detail = check(*args)
    except (Failed, MedflareError, OSError, ValueError) as exc:
        return Check(name, FAIL, _one_line(exc))
    return Check(name, status, detail)


def _run_value(checks: list[Check], name: str, build: Callable[..., tuple[Any, str, str]], *args: Any) -> Any:
    """A check that also yields a value the later checks need (None when it failed)."""
    found: list[Any] = []

    def check() -> tuple[str, str]:
        value, status, detail = build(*args)
        found.append(value)
        return status, detail

    checks.append(_run(name, check))
    return found[0] if found else None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:400] or type(exc).__name__


# ----- the kit ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FedClient:
    """What preflight needs of the kit's ``startup/fed_client.json``: the site's name and the server's address."""

    site: str
    host: str
    port: int

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"


_FED_CLIENT = readback.obj(
    required={"servers": readback.list_of(readback.obj(required={"service": readback.obj(
        required={"target": readback.STR})})), "client": readback.obj(optional={"fqsn": readback.STR})})


def _kit_files(kit: Path) -> tuple[FedClient, str, str]:
    missing = [name for name in KIT_FILES if not (kit / name).exists()]
    if missing:
        raise Failed(f"{kit} is not a site's startup kit: {', '.join(missing)} missing (the kit of a hospital "
                     "holds startup/fed_client.json, its certificate and key, rootCA.pem and local/)")
    client = _fed_client(kit)
    return client, PASS, f"{kit} ({client.site})"


def _fed_client(kit: Path) -> FedClient:
    """The kit's ``startup/fed_client.json``, of the shape FLARE's provisioning writes; Failed (one line) otherwise."""
    path = kit / "startup" / "fed_client.json"
    fix = "the kit was altered: ask the project admin for this site's kit"
    config = readback.check(readback.load_json(path, DataError, fix=fix), _FED_CLIENT, str(path), DataError, fix)
    if not config["servers"]:
        raise Failed(f"{path}: servers is empty; {fix}")
    target = config["servers"][0]["service"]["target"]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise Failed(f"{path}: servers[0].service.target is '{target}', not host:port; {fix}")
    return FedClient(config["client"].get("fqsn") or kit.name, host, int(port))


def _certificate(kit: Path, client: FedClient) -> tuple[str, str]:
    from cryptography.x509.oid import NameOID

    startup = kit / "startup"
    cert, root = _pem_certificate(startup / "client.crt"), _pem_certificate(startup / "rootCA.pem")
    try:
        cert.verify_directly_issued_by(root)
    except Exception as exc:  # noqa: BLE001 - cryptography raises several types for a foreign or altered cert
        # cryptography: ValueError when the issuer is another CA, InvalidSignature when the signature does not hold
        why = "its issuer is another CA" if isinstance(exc, ValueError) else "its signature does not verify"
        raise Failed(f"client.crt is not signed by the kit's rootCA.pem ({why}); the kit was altered "
                     "or mixes two provisionings: ask the project admin for this site's kit") from exc
    names = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if names != [client.site]:
        raise Failed(f"client.crt is issued to {', '.join(names) or 'no site (no CN)'}, not to this site "
                     f"{client.site} (fed_client.json): the kit holds another site's certificate; ask the project "
                     "admin for this site's kit")
    _check_key_pair(startup / "client.key", cert)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if now < start:
        raise Failed(f"client.crt is valid only from {start:%Y-%m-%d %H:%M} UTC; check this machine's clock")
    if now > end:
        raise Failed(f"client.crt expired on {end:%Y-%m-%d} UTC; ask the project admin to provision a new kit")
    days = (end - now).days
    status = WARN if days < CERT_WARN_DAYS else PASS
    return status, f"{cert.subject.rfc4514_string()}, issued by {root.subject.rfc4514_string()}, valid until " \
                   f"{end:%Y-%m-%d} ({days} days); client.key is its key"


def _pem_certificate(path: Path) -> Any:
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError as exc:
        raise Failed(f"{path.name} is not a PEM certificate ({_one_line(exc)}); ask the project admin for this "
                     "site's kit") from exc


def _check_key_pair(path: Path, cert: Any) -> None:
    """``path`` holds the private key of ``cert`` (FLARE's mTLS would refuse the site's connection otherwise)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:  # not a key, encrypted, or of no known kind
        raise Failed(f"client.key is not an unencrypted PEM private key ({_one_line(exc)}); ask the project admin "
                     "for this site's kit") from exc
    public = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*public) != cert.public_key().public_bytes(*public):
        raise Failed("client.key is not the key of client.crt (their public keys differ): the kit mixes two "
                     "sites' or two provisionings' files; ask the project admin for this site's kit")


def _server(kit: Path, client: FedClient) -> tuple[str, str]:
    from nvflare.tool.package_checker.check_rule import CHECK_PASSED, CheckServerAvailable
    from nvflare.tool.package_checker.utils import NVFlareRole

    target, host, port = client.target, client.host, client.port
    try:
        address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as exc:
        raise Failed(f"the server's name {host} does not resolve ({exc.strerror}); ask your IT for a DNS or "
                     "/etc/hosts entry") from exc
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(10)
        if probe.connect_ex((address, port)) != 0:
            raise Failed(f"nothing answers at {target} ({address}): the server is not running, or a firewall "
                         "blocks the port")
    result = CheckServerAvailable("server available", role=NVFlareRole.CLIENT)(str(kit), None)  # FLARE's own
    if result.problem != CHECK_PASSED:
        raise Failed(f"{result.problem} with this kit's certificate: {result.solution}")
    return PASS, f"{target} ({address}) answers this kit's certificate"


def _versions(kit: Path) -> tuple[str, str]:
    from medflare.console.deploy.policies import KIT_VERSIONS_FILE, installed_versions

    here, recorded = installed_versions(), kit / "local" / KIT_VERSIONS_FILE
    if not recorded.is_file():
        return WARN, f"no local/{KIT_VERSIONS_FILE} (a kit medflare did not set up); installed: {_versions_text(here)}"
    kit_versions = _kit_versions(recorded)
    if kit_versions.get("nvflare") != here["nvflare"]:
        raise Failed(f"FLARE {here['nvflare']} is installed but the kit was set up with {kit_versions.get('nvflare')}"
                     f"; install nvflare=={kit_versions.get('nvflare')}")
    if kit_versions.get("medflare") != here["medflare"]:
        return WARN, f"medflare {here['medflare']} is installed, the kit was set up with {kit_versions['medflare']}"
    return PASS, _versions_text(here)


def _kit_versions(recorded: Path) -> dict[str, str]:
    """The versions a kit was set up with (``local/medflare_kit_versions.json``), schema-checked."""
    fix = "the kit's local/ was altered: reinstall its policies (python -m medflare.console.deploy.provision --reinstall)"
    return readback.check(readback.load_json(recorded, DataError, fix=fix),
                          readback.obj(optional={"nvflare": readback.STR, "medflare": readback.STR}),
                          str(recorded), DataError, fix)


def _platform(kit: Path) -> tuple[str, str]:
    """FAIL when the FLARE installed here, or the one the kit was set up with, has known advisories."""
    from medflare.advisories import NVFLARE_FLOOR, installed_nvflare, platform_refusal
    from medflare.console.deploy.policies import KIT_VERSIONS_FILE

    here = installed_nvflare()
    unsafe = platform_refusal(here, "this site")
    recorded = kit / "local" / KIT_VERSIONS_FILE
    if not unsafe and recorded.is_file():
        try:
            kit_nvflare = _kit_versions(recorded).get("nvflare")
        except DataError:  # the versions row reports the malformed file
            kit_nvflare = None
        unsafe = platform_refusal(kit_nvflare, "the kit (set up with it)") if kit_nvflare else ""
    if unsafe:
        raise Failed(unsafe)
    return PASS, f"nvflare {here}: at or above {NVFLARE_FLOOR}, the first release without the known advisories"


def _versions_text(versions: dict[str, str]) -> str:
    return ", ".join(f"{name} {version}" for name, version in versions.items())


def _disk(kit: Path) -> tuple[str, str]:
    free = shutil.disk_usage(kit).free / 2**30
    detail = f"{free:.1f} GiB free where the kit's jobs write ({kit})"
    if free < DISK_FAIL_GIB:
        raise Failed(f"only {detail}; at least {DISK_FAIL_GIB:g} GiB is needed")
    return (WARN if free < DISK_WARN_GIB else PASS), detail


def _devices(site_file: Any) -> tuple[str, str]:
    import torch

    from medflare.distributed import site_distributed_config

    processes = site_distributed_config(site_file).processes
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    found = f"{gpus} CUDA GPU(s): {', '.join(names)}" if gpus else f"CPU only ({os.cpu_count()} cores)"
    if processes > max(gpus, 1):
        return WARN, f"{found}, but distributed.processes is {processes}"
    return PASS, found


# ----- the site's file and data ---------------------------------------------------------------------------------
def _site_file(kit: Path) -> tuple[Any, str, str]:
    from medflare.site_config import SITE_CONFIG_FILE, SiteFile

    site_file = SiteFile.of(kit / "local")
    if site_file.content is None:
        raise Failed(f"no local/{SITE_CONFIG_FILE}: copy local/{SITE_CONFIG_FILE}.example to it and set your "
                     "data source (docs/deploy-hospital-admin.md)")
    return site_file, PASS, str(site_file.path)


def _policy(site_file: Any) -> tuple[Any, str, str]:
    from medflare.site_policy import site_policy

    policy = site_policy(site_file)
    accepts = ", ".join(policy.methods) if policy.methods is not None else "any method"
    required = ", ".join(policy.require) or "nothing"
    return policy, PASS, (f"accepts {accepts}; requires {required}; min_class_samples {policy.min_class_samples}; "
                          f"audit log {policy.audit_log}")


def _site_data(site: str, site_file: Any) -> tuple[Any, str, str]:
    """The site's own data as it reads it for any job (its class_map and window applied, no job's task)."""
    from medflare.data import make_site_data
    from medflare.site_config import read_site_data_config, typed_data_config

    data_config = {**read_site_data_config(site_file, None), "local": True, "num_sites": 1}
    data = make_site_data(typed_data_config(data_config), 0, site)
    names = list(data.class_names)  # the site's own (no job's order), less the classes its class_map leaves out
    return (data, names), PASS, f"{data_config['source']}: {len(data.train)} train / {len(data.val)} val / " \
                       f"{len(data.test)} test images"


def _image_checks(data: Any, names: list[str], floor: int, max_images: int, progress: Progress) -> list[Check]:
    sets = {split: getattr(data, split).images for split in ("train", "val", "test")}
    scan = _scan(sets, max_images, progress)
    return [_corrupt_check(scan), _size_check(scan), _intensity_check(scan), *_channel_check(data),
            _class_check(sets, names, floor)]


def _channel_check(data: Any) -> list[Check]:
    """A WARN row when colour and grey files are mixed (read with the first file's channel count); none otherwise."""
    from medflare.data.readers import channel_mix_note

    note = channel_mix_note(data.train.images.paths or (), data.channels)
    return [Check("image channels", WARN, note)] if note else []


@dataclass
class _Scan:
    read: int = 0
    total: int = 0
    corrupt: list[str] = field(default_factory=list)
    sizes: dict[tuple[int, ...], int] = field(default_factory=dict)
    low: float = float("inf")
    high: float = float("-inf")
    blank: int = 0
    kinds: set[str] = field(default_factory=set)
    # the values deeper files store before they are scaled to [0, 1] (a 12-bit TIFF's 0 to 4095)
    raw_low: float = float("inf")
    raw_high: float = float("-inf")


def _scan(sets: dict[str, Any], max_images: int, progress: Progress) -> _Scan:
    """Read every image of ``sets`` (at most ``max_images`` per split) as training will."""
    scan = _Scan()
    indices = {split: range(len(s) if not max_images else min(len(s), max_images)) for split, s in sets.items()}
    scan.total = sum(len(i) for i in indices.values())
    said = time.time()
    for split, image_set in sets.items():
        for index in indices[split]:
            _read_one(image_set, index, scan)
            if time.time() - said > PROGRESS_SECONDS:
                progress(f"preflight: read {scan.read} of {scan.total} images")
                said = time.time()
    return scan


def _read_one(image_set: Any, index: int, scan: _Scan) -> None:
    from medflare.data.readers import stored_range

    scan.read += 1
    try:
        pixels = image_set.get_image(index)
    except MedflareError:
        scan.corrupt.append(image_set.paths[index] if image_set.paths else f"{image_set.name}[{index}]")
        return
    scan.sizes[pixels.shape[:2]] = scan.sizes.get(pixels.shape[:2], 0) + 1
    scan.kinds.add("8-bit" if pixels.dtype == np.uint8 else "scaled to [0, 1]")
    low, high = float(pixels.min()), float(pixels.max())
    scan.low, scan.high = min(scan.low, low), max(scan.high, high)
    scan.blank += low == high
    stored = stored_range(image_set.paths[index]) if image_set.paths and pixels.dtype != np.uint8 else None
    if stored is not None:
        scan.raw_low, scan.raw_high = min(scan.raw_low, stored[0]), max(scan.raw_high, stored[1])


def _corrupt_check(scan: _Scan) -> Check:
    if scan.corrupt:
        shown = ", ".join(scan.corrupt[:3]) + (f" and {len(scan.corrupt) - 3} more" if len(scan.corrupt) > 3 else "")
        return Check("images", FAIL, f"{len(scan.corrupt)} of {scan.read} images cannot be read: {shown}; replace "
                                     "or remove them")
    return Check("images", PASS, f"all {scan.read} images read" + ("" if scan.read == scan.total else
                                                                    f" of {scan.total}"))


def _size_check(scan: _Scan) -> Check:
    if not scan.sizes:
        return Check("image sizes", WARN, "no image could be read")
    sizes = sorted(scan.sizes, key=lambda hw: -scan.sizes[hw])
    shown = ", ".join(f"{h}x{w} ({scan.sizes[(h, w)]})" for h, w in sizes[:4]) + (" ..." if len(sizes) > 4 else "")
    odd = len(sizes) > 1 or sizes[0][0] != sizes[0][1]
    note = ("; every job resizes them to its own square image size, stretching non-square ones (to keep their "
            "aspect ratio, crop or pad the images to squares)")
    return Check("image sizes", WARN if odd else PASS, shown + (note if odd else ""))


def _intensity_check(scan: _Scan) -> Check:
    if not scan.sizes:
        return Check("intensities", WARN, "no image could be read")
    raw = f"raw {scan.raw_low:g} to {scan.raw_high:g}, scaled to " if scan.raw_low <= scan.raw_high else "values "
    detail = f"{', '.join(sorted(scan.kinds))}; {raw}{scan.low:g} to {scan.high:g}"
    if scan.blank:
        return Check("intensities", WARN, f"{detail}; {scan.blank} image(s) hold one value only (blank?)")
    return Check("intensities", PASS, detail)


def _class_check(sets: dict[str, Any], names: list[str], floor: int) -> Check:
    from medflare.data.types import labelled_counts

    counts = {split: labelled_counts(s.labels, len(names)) for split, s in sets.items()}
    rows = [f"{name} {'/'.join(str(int(counts[s][k])) for s in sets)}" for k, name in enumerate(names)]
    detail = f"{len(names)} classes (train/val/test): {'; '.join(rows)}"
    empty = [name for k, name in enumerate(names) if counts["train"][k] == 0]
    small = [name for k, name in enumerate(names) if 0 < counts["train"][k] < floor]
    if empty:
        return Check("classes", WARN, f"{detail}; no training image of {', '.join(empty)}")
    if small:
        return Check("classes", WARN, f"{detail}; {', '.join(small)} under min_class_samples ({floor}): no "
                                      "statistics about them leave the site")
    return Check("classes", PASS, detail)


def _patient_check(data: Any, site_file: Any) -> tuple[str, str]:
    """Whether every patient's images are in one split (test metrics of a patient also seen in training are
    optimistic): the patient key the source found (``info["grouping"]``), patients per split of what trains and is
    tested, and a WARN naming what the site can do when patients are shared or, for slices, not known."""
    from medflare.data.readers import DICOM_SUFFIXES, NIFTI_SUFFIXES
    from medflare.data.sources import shared_patients
    from medflare.site_config import read_site_data_config

    grouping = _source_info(read_site_data_config(site_file, None)).get("grouping")
    sets = {split: getattr(data, split).images for split in ("train", "val", "test")}
    if grouping is None:  # in memory (MedMNIST, synthetic): the source's own splits
        return PASS, "the source's own train/val/test splits (no patient key)"
    if grouping["key"] is None:
        paths = [path for image_set in sets.values() for path in image_set.paths or []]
        slices = any(path.lower().endswith(DICOM_SUFFIXES + NIFTI_SUFFIXES) for path in paths)
        detail = ("no patient key: each image is split alone, so one patient's images may be in train and test; "
                  "put each patient's files in <class>/<patient>/ folders (or give the DICOMs a PatientID), or add a "
                  "patient_id column to the CSV")
        return (WARN, f"{detail} (these are slices: test metrics are optimistic)") if slices else (PASS, detail)
    counts = "/".join(str(len(set(image_set.patients))) for image_set in sets.values())
    shared = shared_patients(sets)
    detail = f"by {grouping['key']}: {counts} patients (train/val/test)"
    if shared:
        shown = ", ".join(shared[:3]) + (", ..." if len(shared) > 3 else "")
        fix = grouping["note"] or ("a split folder or the CSV's split column puts them there: move each patient's "
                                   "images into one split, or drop the split folders/column so medflare splits by "
                                   "patient")
        return WARN, f"{detail}; {len(shared)} patient(s) in more than one split ({shown}): {fix}"
    return PASS, f"{detail}, none in two splits"


def _audit_log(site_file: Any, policy: Any) -> tuple[list[dict[str, Any]], str, str]:
    """The site's audit log (in ``local/``): its chain holds to the last line, and every ε in it is one a DP-SGD
    accountant can report; yields its records."""
    from medflare.site_policy import audit_file, verify_audit

    path = audit_file(site_file.path.parent, policy.audit_log)
    if not path.exists():
        return [], PASS, f"no {path.name} yet (the site's first job starts it)"
    chain = verify_audit(path.read_bytes())
    if chain.broken is not None:
        raise Failed(f"{path} line {chain.broken} {chain.why}; the lines before it hold. Keep the file as evidence "
                     "and move it aside: the next job starts a new log")
    for number, record in enumerate(chain.records, 1):
        for key in (DP_EPSILON, "dp_epsilon_spent"):
            if key in record and not _is_epsilon(record[key]):
                raise Failed(f"{path} line {number}: {key} is {record[key]!r}, not a finite ε >= 0 (a DP-SGD "
                             "accountant reports nothing else); the line is not medflare's record")
    jobs = len({record.get("job_id") for record in chain.records})
    return chain.records, PASS, f"{path.name}: {len(chain.records)} lines of {jobs} job(s), chain intact; its " \
                                f"last hash {chain.head[:16]} (a copy kept elsewhere shows a removed last line)"


def _is_epsilon(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _dp_budget(site_file: Any, policy: Any, audit: list[dict[str, Any]] | None) -> tuple[str, str]:
    from medflare.dp_sgd import SiteDPPolicy

    dp = site_file.section("dp_sgd", SiteDPPolicy)  # a misspelt option is a FAIL here, as when a job arrives
    if not site_file.get("dp_sgd") and "dp_sgd" not in policy.require:
        return PASS, "no DP-SGD policy (jobs without DP-SGD are accepted)"
    try:
        import opacus  # noqa: F401 - DP-SGD trains with it at this site
    except ImportError as exc:
        raise Failed("this site's policy asks for DP-SGD, but opacus is not installed: pip install "
                     "'medflare[dp]'") from exc
    budget = dp.max_epsilon
    limit = f"each job may spend ε ≤ {budget:g}" if budget else "no per-job ε budget set (max_epsilon)"
    if audit is None:
        return WARN, f"{limit}; what past jobs spent is unknown (the audit log fails its check)"
    return PASS, f"{limit}; past jobs in the audit log spent ε {_epsilon_spent(audit):g} in all"


def _epsilon_spent(audit: list[dict[str, Any]]) -> float:
    """The ε past jobs spent, in all: each job's last report (ε is cumulative within a job), a killed job's too."""
    last: dict[Any, float] = {}
    for record in audit:
        spent = record.get(DP_EPSILON, record.get("dp_epsilon_spent"))
        if spent is not None:
            last[record.get("job_id")] = float(spent)
    return float(sum(last.values()))


# ----- a job at this site ---------------------------------------------------------------------------------------
def _job_checks(job: Path, site: str, site_file: Any, policy: Any) -> list[Check]:
    checks: list[Check] = []
    plan = _run_value(checks, "job", _job_plan, job)
    if plan is not None:
        checks.append(_run("job policy", _job_policy, plan, policy))
        checks.append(_run("job code", _job_code, job, policy))
        checks.append(_run("job platform", _job_platform, plan))
        data = _run_value(checks, "job data", _job_data, plan, site, site_file)
        checks += [Check("job classes", WARN, note) for note in (data.class_notes if data is not None else ())]
    return checks


def _job_plan(job: Path) -> tuple[Any, str, str]:
    from medflare.plan import plan_from_job

    plan = plan_from_job(job)
    return plan, PASS, f"{job} runs {plan.method} (plan {plan.digest()})"


def _job_policy(plan: Any, policy: Any) -> tuple[str, str]:
    reason = policy.refusal(plan)
    if reason:
        raise Failed(f"the site would decline this job: {reason}")
    return PASS, "the site's policy accepts the job"


def _job_code(job: Path, policy: Any) -> tuple[str, str]:
    """The digest of the code the job brings (computed here, as the site computes it when the job arrives), and the
    site policy's verdict on it; a WARN when it differs from the digest the job's export recorded."""
    from medflare.console.job_export import job_code_digest
    from medflare.job_code import META_KEY

    digest = job_code_digest(job)
    refusal = policy.code_refusal(digest)
    if refusal:
        raise Failed(f"the site would decline this job: {refusal}")
    verdict = "pre-installed code: runs this site's own installation" if digest == "preinstalled" else         "approved by this site's policy" if policy.approved_code is not None else "any code is accepted "         "(policy.approved_code is not set)"
    exported = readback.load_json(job / "meta.json", DataError).get(META_KEY)
    if exported is not None and exported != digest:
        return WARN, f"{digest}: {verdict}; its export recorded {str(exported)[:80]} (the code changed since)"
    return PASS, f"{digest}: {verdict}"


def _job_platform(plan: Any) -> tuple[str, str]:
    """WARN when this site runs another FLARE release than the job was exported with."""
    from medflare.advisories import exported_mismatch, installed_nvflare

    if not plan.nvflare:
        return WARN, "the job does not record the FLARE release it was exported with (export it again)"
    other = exported_mismatch(installed_nvflare(), plan.nvflare, "this site")
    if other:
        return WARN, f"{other}; medflare was tested with the job's"
    return PASS, f"the job was exported with nvflare {plan.nvflare}, the release installed here"


def _job_data(plan: Any, site: str, site_file: Any) -> tuple[Any, str, str]:
    from medflare.site_runtime import load_site_data

    settings, index = plan.localise(site, site_file, False)
    data = load_site_data(settings, index, site)
    task = settings.task
    names = f"classes {task.class_names}" if task.class_names else f"{task.num_classes} classes (unnamed)"
    detail = f"{len(data.train)} train images fit the job's {names}, {task.in_channels} channel(s)"
    native = _source_info(settings.data)["image_size"]
    if native != task.image_size:
        return data, WARN, f"{detail}; this site's images ({native} px) are resized to the job's {task.image_size} px"
    return data, PASS, f"{detail}, {native} px"


def _source_info(data_config: dict[str, Any]) -> dict[str, Any]:
    """What the site's source says of itself: class names (when it names them) and its first image's size (the
    classes its class_map leaves out unread, as the job reads it)."""
    from medflare.data.classes import left_out_classes
    from medflare.data.sources import load_source

    return load_source(data_config["source"], seed=int(data_config.get("seed", 0)),
                       left_out=left_out_classes(data_config.get("class_map")),
                       patient_column=str(data_config.get("patient_column", ""))).info


# ----- the report -----------------------------------------------------------------------------------------------
def overall(checks: list[Check]) -> str:
    """FAIL if any check failed, else WARN if any warned, else PASS."""
    statuses = {c.status for c in checks}
    return FAIL if FAIL in statuses else WARN if WARN in statuses else PASS


def table(checks: list[Check]) -> str:
    """The report as aligned text columns, the overall result last."""
    width = max(len(c.check) for c in checks)
    lines = [f"{c.status}  {c.check.ljust(width)}  {c.detail}" for c in checks]
    return "\n".join([*lines, f"preflight: {overall(checks)}"])


def as_json(checks: list[Check]) -> str:
    """The report as one JSON object: overall and the checks in order."""
    return json.dumps({"overall": overall(checks), "checks": [asdict(c) for c in checks]}, ensure_ascii=False)
