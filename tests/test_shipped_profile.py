"""The shipped cost bundles come from the shipped H200 profiles, which are package data
(simtree/data/profiles/h200/), not experiments among the reports; one bundle per default
deployment whose rank has rows there (simtree/data/deployments.yaml), none for the others."""
import hashlib
import json
from importlib import resources

import pytest

from simtree.deploy.shipped import bundle_name, profile_for, shipped_deployments, waiting

SHIPPED = [(m, d) for m, d in shipped_deployments() if (m, d) not in waiting()]


def _folder():
    return resources.files("simtree.data.profiles.h200")


def _bundle(model: str, dep) -> dict:
    return json.loads((resources.files("simtree.data.costs") / bundle_name("h200", model, dep)).read_text())


def _without_source_path(bundle: dict) -> str:
    # the bundle records the path it was fitted from; the path may move, the content does not
    text = json.dumps(bundle, sort_keys=True)
    for recorded in {bundle["meta"]["source"]["profile"], bundle["verify"]["info"]["source"]["profile"]}:
        text = text.replace(json.dumps(recorded), '"<profile>"')
    return text


def test_each_default_names_its_rank_profile():
    # profile.csv (whole models, kernel-level sweep) and a rank profile both hold Qwen at tp=1:
    # deployments.yaml names the one its bundle comes from
    with resources.as_file(_folder()) as folder:
        for model, dep in SHIPPED:
            assert profile_for(model, dep, folder).name == f"profile_{model}_{dep.tag}.csv"


def test_the_profile_and_its_sidecars_are_package_data():
    folder = _folder()
    for name in ("profile.csv", "profile.meta.json", "profile.compose.json"):
        assert (folder / name).is_file(), name
    meta = json.loads((folder / "profile.meta.json").read_text())
    assert meta["gpu_name"] == "NVIDIA H200" and meta["sweep"] == "default_gpu"


def test_exactly_the_defaults_with_a_profile_ship_a_bundle():
    shipped = sorted(p.name for p in resources.files("simtree.data.costs").iterdir() if p.name.endswith(".json"))
    assert shipped == sorted(bundle_name("h200", m, d) for m, d in SHIPPED)
    assert ("qwen3.6-27b", "tp=1") in [(m, d.name) for m, d in SHIPPED]
    assert not any(name.startswith("h200_deepseek-v4-flash_tp1") for name in shipped)   # no impossible default


@pytest.mark.parametrize("model, dep", SHIPPED, ids=lambda x: str(x))
def test_each_shipped_bundle_names_its_profile_by_its_hash(model, dep):
    with resources.as_file(_folder()) as folder:
        table = profile_for(model, dep, folder)
        digest = "sha256:" + hashlib.sha256(table.read_bytes()).hexdigest()
    bundle = _bundle(model, dep)
    assert bundle["meta"]["model"] == model and bundle["meta"]["deployment"] == dep.name
    assert bundle["meta"]["source"]["sha256"] == digest


@pytest.mark.slow
@pytest.mark.parametrize("model, dep", SHIPPED, ids=lambda x: str(x))
def test_refitting_the_shipped_profile_gives_the_shipped_bundle(model, dep, tmp_path):
    # what scripts/ship_defaults.sh does (simtree fit, form auto with the per-bin reference)
    from simtree.costs.profile_fit import fit_profile

    with resources.as_file(_folder()) as folder:
        table = profile_for(model, dep, folder)
        # a sweep-only rank profile has no whole draft steps: ship_defaults.sh assumes C_d from C_v
        sweep_only = not any(line.startswith("draft_step,") for line in table.read_text().splitlines())
        report = fit_profile(table, model=model, deployment=dep.name, reference_forms=("per_bin",),
                             draft_from_verify=sweep_only)
    out = tmp_path / f"{model}.json"
    report.bundle.save(out)
    # equal up to the solver's floating-point noise (about 1e-10 relative differs between BLAS builds)
    refit = json.loads(out.read_text(), parse_float=_rounded)
    shipped = json.loads(json.dumps(_bundle(model, dep)), parse_float=_rounded)
    assert _without_source_path(refit) == _without_source_path(shipped)


def _rounded(text: str) -> float:
    """A JSON number to 7 significant digits."""
    return float(f"{float(text):.7g}")
