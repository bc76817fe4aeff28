"""apps/: the committed ready-to-submit job of every registered method matches a fresh regeneration."""

from __future__ import annotations

import json
from pathlib import Path

from medflare.console.deploy.apps import APPS_DIR, add_code, stale_apps, write_app
from medflare.plan import plan_from_job
from medflare.registry import list_methods
from medflare.server_setup import DEPLOY_ROBUST


def test_apps_are_up_to_date() -> None:
    differences = stale_apps()
    assert differences == [], "apps/ is stale; run 'make apps':\n" + "\n".join(differences[:20])


def test_every_registered_method_has_a_preinstalled_app() -> None:
    assert sorted(p.name for p in APPS_DIR.iterdir() if p.is_dir()) == list_methods()
    for method in list_methods():
        app = APPS_DIR / method
        meta = json.loads((app / "meta.json").read_text())
        assert meta["scope"] == f"medflare-{method}" and meta["deploy_map"] == {"app": ["@ALL"]}
        assert not (app / "app" / "custom").exists()  # pre-installed: configs only
        plan = plan_from_job(app)
        assert plan.method == method and plan.data == {"source": "site"}  # no data path in the job
        server = (app / "app" / "config" / "config_fed_server.json").read_text()
        assert '"path": "medflare.' in server and '"path": "nvflare.' not in server


def test_add_code_turns_an_app_into_a_byoc_job(tmp_path: Path) -> None:
    job = add_code(write_app(list_methods()[0], tmp_path))
    assert (job / "app" / "custom" / "medflare" / "flare" / "executor.py").is_file()
    assert not list((job / "app" / "custom").rglob("__pycache__"))


def test_regenerating_removes_only_what_medflare_recorded_writing(tmp_path: Path, capsys) -> None:
    """Issue 49, item 5: the folder of a method no longer registered goes only when it holds medflare's recorded,
    unchanged files; a folder someone put there, or one with a file changed, is kept and named."""
    from medflare.console.deploy.apps import write_per_method

    method = list_methods()[0]
    write_app(method, tmp_path)
    (tmp_path / method).rename(tmp_path / "retired")  # recorded under its old name: not medflare's any more
    write_app(list_methods()[1], tmp_path)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    write_per_method(tmp_path, [list_methods()[1]], write_app)
    assert (tmp_path / "theirs" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "retired" / "meta.json").is_file()  # moved: its content is recorded under another name
    assert "kept " in capsys.readouterr().err
    (tmp_path / "retired").rename(tmp_path / method)
    write_per_method(tmp_path, [list_methods()[1]], write_app)
    assert not (tmp_path / method).exists() and (tmp_path / list_methods()[1] / "meta.json").is_file()


def test_production_jobs_turn_the_robust_aggregation_on() -> None:
    """Issue 7.3: the norm bound and the share cap are on in every ready-made production job, and a cap that
    the sites a round needs could not meet would only relax (max_share * min_clients >= 1). Issue 26: they are the
    defaults every deployment gets, and meta.json tells a reviewer so."""
    for method in list_methods():
        plan = plan_from_job(APPS_DIR / method)
        robust = plan.robust
        assert robust == DEPLOY_ROBUST, method
        assert robust["max_norm_ratio"] > 1 and 0 < robust["max_share"] < 1, method
        assert robust["max_share"] * plan.min_clients >= 1, method
        meta = json.loads((APPS_DIR / method / "meta.json").read_text())
        assert meta["robust_aggregation"] == {"on": True, **DEPLOY_ROBUST}, method


def test_every_shipped_job_names_its_classes_or_carries_the_placeholder_sites_refuse() -> None:
    """Issue 61: every job in apps/ had class_names null, so a site with Effusion/Normal/Pneumonia passed and trained
    in whatever order its folders sorted into. Every shipped job (apps/ and job_templates/) now carries names: these
    read site data the lead has not seen, so the placeholder <class 1>, <class 2>, which every site refuses."""
    from medflare.data.classes import placeholder_class_names, placeholder_refusal

    plans = {path: json.loads(path.read_text())["plan"] for path in [
        *sorted(APPS_DIR.glob("*/app/config/medflare_plan.json")),
        *sorted((APPS_DIR.parent / "job_templates").glob("*/medflare_plan.json"))]}
    assert len(plans) == 2 * len(list_methods())
    for path, plan in plans.items():
        task = plan["task"]
        assert task["class_names"] == placeholder_class_names(task["num_classes"]), path
        assert placeholder_refusal(task["class_names"], "site-1"), path  # what a site says when the job arrives
