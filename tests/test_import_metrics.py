"""simtree import-metrics: vLLM / SGLang metrics (fixtures in the engines' own formats,
tests/data/engines/README.md says where each name comes from) -> an acceptance file plan takes."""
import http.server
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from simtree.acceptance.engine_file import engine_acceptance_model
from simtree.acceptance.model import get_workload
from simtree.cli import app
from simtree.engines.metrics import import_metrics
from simtree.errors import SimtreeError

DATA = Path(__file__).parent / "data" / "engines"
runner = CliRunner()


def _run(*args):
    return runner.invoke(app, list(args))


def test_vllm_one_scrape_reads_counters_and_per_position_rates():
    got = import_metrics([str(DATA / "vllm_metrics.prom")], "vllm")
    assert got.num_drafts == 1000 and got.draft_len == 3
    assert got.mean_accepted_tokens == pytest.approx(1 + 1710 / 1000)
    assert got.per_position_accept_rate == pytest.approx([0.8, 0.56, 0.35])
    d = got.to_dict()
    assert d["conditional_accept_rate"] == pytest.approx([0.8, 0.7, 0.625])
    # the standard error of the mean from the nested per-position events, checked by sampling
    rng = np.random.default_rng(0)
    cond = np.array([0.8, 0.7, 0.625])
    draws = np.cumprod(rng.random((200_000, 3)) < cond, axis=1).sum(1)
    assert got.mean_accepted_tokens_se == pytest.approx(draws.std() / np.sqrt(1000), rel=0.02)


def test_the_file_holds_the_fields_the_reader_checks_in_the_schema_order():
    d = import_metrics([str(DATA / "vllm_metrics.prom")], "vllm").to_dict()
    assert list(d) == ["schema", "engine", "sources", "mean_accepted_tokens", "mean_accepted_tokens_se", "draft_len",
                       "num_drafts", "num_draft_tokens", "num_accepted_tokens", "per_position_accept_rate",
                       "conditional_accept_rate", "notes"]
    assert d["schema"] == "simtree.engine_acceptance/1" and d["engine"] == "vllm" and d["num_accepted_tokens"] == 1710
    assert engine_acceptance_model(d, "x").meta["num_drafts"] == 1000


def test_vllm_two_scrapes_take_the_window_and_plan_reads_the_file(tmp_path):
    r = _run("import-metrics", str(DATA / "vllm_metrics.prom"), str(DATA / "vllm_metrics_later.prom"),
             "--engine", "vllm", "--out", str(tmp_path))
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "acceptance.json").read_text())
    assert data["num_drafts"] == 2000 and data["num_accepted_tokens"] == 4970 - 1710
    assert data["per_position_accept_rate"] == pytest.approx([1550 / 2000, 1060 / 2000, 650 / 2000])
    wl = get_workload(str(tmp_path / "acceptance.json"))
    # the model reproduces the measured chain: mean accepted drafts of a 3-draft chain
    assert 1 + wl.acceptance.linear_accepted(4) == pytest.approx(data["mean_accepted_tokens"], rel=1e-9)


@pytest.mark.parametrize("name, draft_len, drafts", [("sglang_metrics.prom", 3, 5400),
                                                     ("sglang_server_info.json", 3, None),
                                                     ("sglang_requests.jsonl", 3, 250)])
def test_sglang_sources(name, draft_len, drafts, tmp_path):
    got = import_metrics([str(DATA / name)], "sglang")
    assert got.draft_len == draft_len and got.num_drafts == drafts
    assert 2.5 < got.mean_accepted_tokens < 2.8
    if name.endswith(".jsonl"):   # 1 + correct drafts / verify rounds, pooled over requests
        assert got.mean_accepted_tokens == pytest.approx(1 + (161 + 77 + 194) / 250)
        assert got.mean_accepted_tokens_se > 0
    acc = engine_acceptance_model(got.to_dict(), name)
    assert 1 + acc.linear_accepted(draft_len + 1) == pytest.approx(got.mean_accepted_tokens, rel=1e-6)


def test_url_on_loopback(tmp_path):
    body = (DATA / "vllm_metrics.prom").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        r = _run("import-metrics", url, "--engine", "vllm", "--out", str(tmp_path))
        assert r.exit_code == 0, r.output
        assert json.loads((tmp_path / "acceptance.json").read_text())["sources"] == [url]
    finally:
        server.shutdown()
        server.server_close()


def _bad(tmp_path, *sources, engine="vllm"):
    out = tmp_path / "out"
    with pytest.raises(SimtreeError) as exc:
        import_metrics([str(s) for s in sources], engine)
    r = _run("import-metrics", *[str(s) for s in sources], "--engine", engine, "--out", str(out))
    assert isinstance(r.exception, SimtreeError) and not out.exists()   # the CLI prints it as one `error:` line
    msg = str(exc.value)
    assert "\n" not in msg and str(r.exception) == msg
    return msg


def test_bad_inputs_one_line_nothing_written(tmp_path):
    no_spec = tmp_path / "plain.prom"
    no_spec.write_text("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 3\n")
    assert "no vLLM spec-decode series" in _bad(tmp_path, no_spec)
    assert "no SGLang spec-decode series" in _bad(tmp_path, no_spec, engine="sglang")
    assert "went backwards" in _bad(tmp_path, DATA / "vllm_metrics_later.prom", DATA / "vllm_metrics.prom")
    gaps = tmp_path / "gaps.prom"
    gaps.write_text("\n".join(line for line in (DATA / "vllm_metrics.prom").read_text().splitlines()
                              if 'position="1"' not in line))
    assert "gaps: positions [1] missing" in _bad(tmp_path, gaps)
    more = tmp_path / "more.prom"   # 5000 accepted of 3000 drafted: it wrote a mean of 6 for draft length 3
    more.write_text((DATA / "vllm_metrics.prom").read_text().replace("} 1710.0", "} 5000.0"))
    assert "5000 exceeds the 3000 draft tokens" in _bad(tmp_path, more)
    assert _bad(tmp_path, DATA) == f"{DATA}: a folder (give a metrics file or an http:// URL)"   # was 'no such file'
    msg = _bad(tmp_path, "http://127.0.0.1:9/metrics")   # port 9 (discard): nothing listens
    assert msg.startswith("cannot read http://127.0.0.1:9/metrics")


def test_sglang_counter_backwards_and_per_position_backwards(tmp_path):
    later = tmp_path / "sglang_later.prom"
    later.write_text((DATA / "sglang_metrics.prom").read_text().replace("} 5400.0", "} 9000.0"))
    assert "sglang:spec_verify_calls_total went backwards" in _bad(tmp_path, later, DATA / "sglang_metrics.prom",
                                                                   engine="sglang")
    # the totals rise but one position's counter falls: refused, naming the position
    early = tmp_path / "early.prom"
    early.write_text("\n".join(line.rsplit(" ", 1)[0] + " 1e9" if 'position="2"' in line else line
                               for line in (DATA / "vllm_metrics.prom").read_text().splitlines()))
    assert "position=2} went backwards" in _bad(tmp_path, early, DATA / "vllm_metrics_later.prom")


def test_a_counter_that_is_not_a_finite_count_is_named(tmp_path):
    """NaN, +Inf (both legal in the exposition format) or a negative value in a counter: one line
    naming the series, not an overflow traceback (Inf) or a misleading "series missing" (NaN)."""
    page = (DATA / "vllm_metrics.prom").read_text()
    for value, counter in [("+Inf", "num_drafts_total"), ("NaN", "num_accepted_tokens_total"),
                           ("-5", "num_drafts_total")]:
        bad = tmp_path / f"{counter}.prom"
        bad.write_text("\n".join(line.rsplit(" ", 1)[0] + f" {value}" if line.startswith(f"vllm:spec_decode_{counter}{{")
                                 else line for line in page.splitlines()))
        msg = _bad(tmp_path, bad)
        assert f"counter vllm:spec_decode_{counter}{{engine=\"0\"" in msg and "a counter is a finite count >= 0" in msg


@pytest.mark.parametrize("field, value", [("spec_verify_ct", "95"), ("spec_verify_ct", -95),
                                          ("spec_accept_length", "2.7"), ("spec_num_proposed_drafts", 1e400),
                                          ("spec_num_correct_drafts", -1)])
def test_a_sglang_request_field_that_is_not_a_count_is_named(tmp_path, field, value):
    records = [json.loads(line) for line in (DATA / "sglang_requests.jsonl").read_text().splitlines() if line.strip()]
    records[1]["meta_info"][field] = value
    bad = tmp_path / "requests.json"
    bad.write_text(json.dumps(records))
    msg = _bad(tmp_path, bad, engine="sglang")
    assert msg.startswith(f"{bad} record 2: meta_info.{field} must be a finite number >= 0, got {value!r}")


def test_an_acceptance_file_whose_rates_disagree_is_refused(tmp_path):
    """engine_acceptance_model read conditional_accept_rate alone: an edited (or impossible)
    per_position_accept_rate was ignored, and a file with only per-position rates fell back to
    the mean accepted length."""
    data = import_metrics([str(DATA / "vllm_metrics.prom")], "vllm").to_dict()
    with pytest.raises(SimtreeError, match=r"conditional_accept_rate .* is not what per_position_accept_rate "
                                           r"\[0.9, 0.5, 0.2\] gives \(\[0.9, 0.555556, 0.4\]\)"):
        engine_acceptance_model({**data, "per_position_accept_rate": [0.9, 0.5, 0.2]}, "f.json")
    for bad in ([0.8, 0.56, 0.79], [1.5], ["x"], {"a": 1}):
        with pytest.raises(SimtreeError, match="per_position_accept_rate must be probabilities that do not rise"):
            engine_acceptance_model({**data, "per_position_accept_rate": bad}, "f.json")
    both = engine_acceptance_model(data, "f.json")
    alone = engine_acceptance_model({k: v for k, v in data.items() if k != "conditional_accept_rate"}, "f.json")
    assert np.array_equal(alone.tables, both.tables) and "per-position rates" in alone.source


@pytest.mark.parametrize("field, value", [("engine", None), ("engine", ""), ("engine", 3), ("sources", "a.prom"),
                                          ("sources", [1]), ("mean_accepted_tokens", None),
                                          ("mean_accepted_tokens", "2.7"), ("mean_accepted_tokens", 0.5),
                                          ("mean_accepted_tokens", True), ("mean_accepted_tokens_se", -0.1),
                                          ("mean_accepted_tokens_se", "x"), ("draft_len", 0), ("draft_len", 2.5),
                                          ("draft_len", "3"), ("num_drafts", -1), ("num_drafts", [1000]),
                                          ("num_draft_tokens", 1.5), ("num_accepted_tokens", False),
                                          ("notes", None), ("notes", "n")])
def test_an_acceptance_file_field_missing_or_of_the_wrong_kind_is_one_line_naming_it(tmp_path, field, value):
    """The metadata of the file (what the writer puts there) is checked when it is read, by plan's
    --workload as by import-metrics before it writes: a field missing or of the wrong kind is one
    line naming the file and the field, with the per-position rates or without them."""
    data = import_metrics([str(DATA / "vllm_metrics.prom")], "vllm").to_dict()
    no_rates = {**data, "per_position_accept_rate": None, "conditional_accept_rate": None}
    for base in (data, no_rates):
        path = tmp_path / "acceptance.json"
        path.write_text(json.dumps({**base, field: value}))
        with pytest.raises(SimtreeError) as err:
            get_workload(str(path))
        assert str(err.value).startswith(f"{path}: {field} must be ") and str(err.value).endswith(f"got {value!r}")
        path.write_text(json.dumps({k: v for k, v in base.items() if k != field}))
        with pytest.raises(SimtreeError, match=f"^{path}: the engine acceptance file has no '{field}' field"):
            get_workload(str(path))


def test_an_acceptance_file_reads_its_counts_as_whole_numbers(tmp_path):
    """Null where the source had none (SGLang /server_info: no draft count); 3.0 reads as 3."""
    data = import_metrics([str(DATA / "sglang_server_info.json")], "sglang").to_dict()
    assert data["num_drafts"] is None and data["mean_accepted_tokens_se"] is None
    path = tmp_path / "acceptance.json"
    path.write_text(json.dumps({**data, "draft_len": 3.0}))
    wl = get_workload(str(path))
    assert wl.acceptance.meta["num_drafts"] is None
    assert 1 + wl.acceptance.linear_accepted(4) == pytest.approx(data["mean_accepted_tokens"], rel=1e-6)
    path.write_text(json.dumps({**data, "num_drafts": 250.0}))
    assert get_workload(str(path)).acceptance.meta["num_drafts"] == 250
    assert isinstance(get_workload(str(path)).acceptance.meta["num_drafts"], int)
