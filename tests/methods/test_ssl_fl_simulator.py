"""SSL-FL end to end in FLARE's simulator: pre-training then fine-tuning in one job, for Fed-MAE and Fed-BEiT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from medflare.console.simulate import run_simulation
from medflare.plan import resolve
from medflare.run_config import RunConfig

pytestmark = pytest.mark.slow

JOBS = {  # 2 pre-training rounds, then 2 fine-tuning rounds (Fed-BEiT first trains its tokenizer for 1 round)
    "fed-mae": ({"pretrain_rounds": 2}, ["pretrain", "pretrain", "finetune", "finetune"]),
    "fed-beit": ({"tokenizer_rounds": 1, "pretrain_rounds": 2, "min_code_perplexity": 0.0}, ["tokenizer", "pretrain", "pretrain", "finetune", "finetune"]),
}
PRETRAIN_ONLY = {"fed-mae": "decoder.", "fed-beit": "lm_head."}
EVALUATION = {"eval_val", "eval_test"}


def _audit(out: Path, site: str) -> list[dict]:
    path = out / "sites" / site / "medflare_payload_audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# staged pre-training: Fed-MAE is make test's smoke run of the pattern, Fed-BEiT (a third stage) is make test-heavy's
@pytest.mark.parametrize("method", [pytest.param("fed-beit", marks=pytest.mark.heavy),
                                    pytest.param("fed-mae", marks=pytest.mark.smoke)])
def test_one_job_pretrains_then_finetunes_a_tiny_vit(method: str, tmp_path: Path) -> None:
    method_args, stages = JOBS[method]
    run = RunConfig(
        method=method, model="vit_micro", rounds=len(stages), clients=2, method_args=method_args, audit=True,
        data={"source": "synthetic:n=200,n_val=40,n_test=40,classes=3", "partition": "dirichlet:1.0", "label_fraction": 0.5},
        train={"max_steps": 2, "batch_size": 16},
    )
    out = tmp_path / method
    summary = run_simulation(resolve(run, "byoc"), out, echo=lambda line: None)

    assert summary["rounds_completed"] == len(stages)
    assert [entry["stage"] for entry in summary["per_round"]] == stages
    for entry, stage in zip(summary["per_round"], stages):
        if stage != "finetune":  # pre-training weighs sites by all their images: half of them are unlabelled here
            images = {s: summary["clients"][s]["n_train"] for s in run.site_names}
            assert entry["share"] == pytest.approx({s: n / sum(images.values()) for s, n in images.items()})
    assert 0.0 <= summary["final"]["accuracy"] <= 1.0 and set(summary["final"]["by_site"]) == set(run.site_names)

    results = [r for r in _audit(out, "site-1") if r["direction"] == "result" and r["task"] == "train"]
    assert len(results) == len(stages)
    pretrain_key = PRETRAIN_ONLY[method]
    for record, stage in zip(results, stages):
        sent = set(record["arrays"])
        scored = stage == "finetune"
        assert bool(EVALUATION & set(record["meta"])) == scored, f"{stage}: evaluation sent only when scored"
        assert any(k.startswith(pretrain_key) for k in sent) == (stage == "pretrain"), f"{stage}: {pretrain_key}*"
        assert any(k.startswith("backbone.blocks.") for k in sent) == (stage != "tokenizer")
        assert "n_images" in record["meta"]
    model = torch.load(out / "FL_global_model.pt", weights_only=False)["model"]
    assert any(k.startswith(pretrain_key) for k in model)  # the server keeps them; they just stop travelling
