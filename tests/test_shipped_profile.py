"""The shipped cost bundles come from the shipped H200 profile, which is package data
(simtree/data/profiles/h200/), not an experiment among the reports."""
import hashlib
import json
from importlib import resources

import pytest

MODELS = ("qwen3.6-27b", "deepseek-v4-flash")


def _profile():
    return resources.files("simtree.data.profiles.h200") / "profile.csv"


def _bundle(model: str) -> dict:
    return json.loads((resources.files("simtree.data.costs") / f"h200_{model}.json").read_text())


def _without_source_path(bundle: dict) -> str:
    # the bundle records the path it was fitted from; that path moved, the content did not
    text = json.dumps(bundle, sort_keys=True)
    for recorded in {bundle["meta"]["source"]["profile"], bundle["verify"]["info"]["source"]["profile"]}:
        text = text.replace(json.dumps(recorded), '"<profile>"')
    return text


def test_the_profile_and_its_sidecars_are_package_data():
    folder = resources.files("simtree.data.profiles.h200")
    for name in ("profile.csv", "profile.meta.json", "profile.compose.json"):
        assert (folder / name).is_file(), name
    meta = json.loads((folder / "profile.meta.json").read_text())
    assert meta["gpu_name"] == "NVIDIA H200" and meta["sweep"] == "default_gpu"


@pytest.mark.parametrize("model", MODELS)
def test_each_shipped_bundle_names_the_shipped_profile_by_its_hash(model):
    digest = "sha256:" + hashlib.sha256(_profile().read_bytes()).hexdigest()
    bundle = _bundle(model)
    assert bundle["meta"]["model"] == model
    assert bundle["meta"]["source"]["sha256"] == digest


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_refitting_the_shipped_profile_gives_the_shipped_bundle(model, tmp_path):
    # what scripts/ship_defaults.sh does (simtree fit, form auto with the per-bin reference)
    from simtree.costs.profile_fit import fit_profile

    with resources.as_file(_profile()) as path:
        report = fit_profile(path, model=model, reference_forms=("per_bin",))
    out = tmp_path / f"{model}.json"
    report.bundle.save(out)
    assert _without_source_path(json.loads(out.read_text())) == _without_source_path(_bundle(model))
