"""The shipped cost bundles come from the shipped profiles of each machine, which are package
data (simtree/data/profiles/<machine>/), not experiments among the reports; one bundle per default
deployment whose rank has rows there (simtree/data/deployments.yaml), none for the others."""
import hashlib
import json
from importlib import resources

import pytest

from simtree.deploy.shipped import bundle_name, profile_for, shipped_deployments, shipped_machines, waiting

MACHINES = [m for m in shipped_machines() if resources.files("simtree.data.profiles").joinpath(m).is_dir()]
SHIPPED = [(machine, m, d) for machine in MACHINES for m, d in shipped_deployments(machine)
           if (m, d) not in waiting(machine)]


def _folder(machine: str = "h200"):
    return resources.files(f"simtree.data.profiles.{machine}")


def _bundle(machine: str, model: str, dep) -> dict:
    return json.loads((resources.files("simtree.data.costs") / bundle_name(machine, model, dep)).read_text())


def _without_source_path(bundle: dict) -> str:
    # the bundle records the path it was fitted from; the path may move, the content does not
    text = json.dumps(bundle, sort_keys=True)
    for recorded in {bundle["meta"]["source"]["profile"], bundle["verify"]["info"]["source"]["profile"]}:
        text = text.replace(json.dumps(recorded), '"<profile>"')
    return text


def test_both_machines_ship_real_defaults():
    assert {"h100", "h200"} <= set(MACHINES)
    assert {(machine, m, d.name) for machine, m, d in SHIPPED} >= {
        ("h100", "deepseek-v4-flash", "ep=8"), ("h100", "qwen3.6-27b", "tp=1"), ("h200", "qwen3.6-27b", "tp=1")}


def test_each_default_names_its_rank_profile():
    # profile.csv (whole models, kernel-level sweep) and a rank profile both hold Qwen at tp=1 on
    # the H200: deployments.yaml names the one its bundle comes from
    for machine, model, dep in SHIPPED:
        with resources.as_file(_folder(machine)) as folder:
            assert profile_for(model, dep, folder, machine).name == f"profile_{model}_{dep.tag}.csv"


def test_the_profile_and_its_sidecars_are_package_data():
    folder = _folder()
    for name in ("profile.csv", "profile.meta.json", "profile.compose.json"):
        assert (folder / name).is_file(), name
    meta = json.loads((folder / "profile.meta.json").read_text())
    assert meta["gpu_name"] == "NVIDIA H200" and meta["sweep"] == "default_gpu"


def test_exactly_the_defaults_with_a_profile_ship_a_bundle():
    shipped = sorted(p.name for p in resources.files("simtree.data.costs").iterdir() if p.name.endswith(".json"))
    assert shipped == sorted(bundle_name(machine, m, d) for machine, m, d in SHIPPED)
    assert ("h200", "qwen3.6-27b", "tp=1") in [(machine, m, d.name) for machine, m, d in SHIPPED]
    assert not any("_deepseek-v4-flash_tp1" in name for name in shipped)   # no impossible default


@pytest.mark.parametrize("machine, model, dep", SHIPPED, ids=lambda x: str(x))
def test_each_shipped_bundle_names_its_profile_by_its_hash(machine, model, dep):
    with resources.as_file(_folder(machine)) as folder:
        table = profile_for(model, dep, folder, machine)
        digest = "sha256:" + hashlib.sha256(table.read_bytes()).hexdigest()
    bundle = _bundle(machine, model, dep)
    assert bundle["meta"]["model"] == model and bundle["meta"]["deployment"] == dep.name
    assert bundle["meta"]["source"]["sha256"] == digest
    assert bundle["meta"]["source"]["profile"] == f"simtree/data/profiles/{machine}/{table.name}"


@pytest.mark.slow
@pytest.mark.parametrize("machine, model, dep", SHIPPED, ids=lambda x: str(x))
def test_refitting_the_shipped_profile_gives_the_shipped_bundle(machine, model, dep, tmp_path):
    # what scripts/ship_defaults.sh does (simtree fit, form auto with the per-bin reference)
    from simtree.costs.profile_fit import fit_profile
    from simtree.deploy.shipped import stamp_caveat

    with resources.as_file(_folder(machine)) as folder:
        table = profile_for(model, dep, folder, machine)
        # a sweep-only rank profile has no whole draft steps: ship_defaults.sh assumes C_d from C_v
        sweep_only = not any(line.startswith("draft_step,") for line in table.read_text().splitlines())
        report = fit_profile(table, model=model, deployment=dep.name, reference_forms=("per_bin",),
                             draft_from_verify=sweep_only)
    out = tmp_path / f"{model}.json"
    report.bundle.save(out)
    stamp_caveat(out, machine)   # ship_defaults.sh stamps the deployments.yaml entry's caveat
    # equal up to the solver's floating-point noise: the fitted values to 7 significant digits (about
    # 1e-10 relative differs between BLAS builds); the held-out errors the fit scores its forms by to 4
    # (a form's k folds are solved to the solver's tolerance, and its dependencies' releases move
    # them by up to about 1e-5 relative: seen on the V4 moe form's p90)
    refit = _rounded(json.loads(out.read_text()))
    shipped = _rounded(json.loads(json.dumps(_bundle(machine, model, dep))))
    assert _without_source_path(refit) == _without_source_path(shipped)


def _rounded(value, digits: int = 7):
    """``value`` (parsed JSON) with every float to ``digits`` significant digits, 4 under fit_error,
    and below 1e-12 (microseconds and their coefficients) 0."""
    if isinstance(value, dict):
        return {k: _rounded(v, 4 if k == "fit_error" else digits) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    if not isinstance(value, float):
        return value
    return 0.0 if abs(value) < 1e-12 else float(f"{value:.{digits}g}")   # a solver's zero (1.8e-16) is zero
