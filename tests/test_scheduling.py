"""``make test``'s split of the suite over pytest-xdist workers (tests/conftest.py)."""

from .conftest import work_unit


def test_poc_modules_share_one_worker_and_parametrized_cases_spread() -> None:
    assert work_unit("tests/deploy/test_poc_end_to_end.py::test_member_cannot_submit") == "poc"
    assert work_unit("tests/deploy/test_poc_faults.py::test_x[preinstalled]") == "poc"
    assert work_unit("tests/deploy/test_apps.py::test_x") == "tests/deploy/test_apps.py"
    assert work_unit("tests/integration/test_resume.py::Test::test_y") == "tests/integration/test_resume.py"
    case = "tests/integration/test_every_method_simulator.py::test_run[fedavg]"
    assert work_unit(case) == case


def test_the_template_cases_share_a_worker_so_their_jobs_are_created_once() -> None:
    case = "tests/deploy/test_templates.py::test_job_create_yields_exactly_the_exported_job[fedavg]"
    assert work_unit(case) == "tests/deploy/test_templates.py"
