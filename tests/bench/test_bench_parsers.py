"""`tokenmill bench parsers --quick` runs end to end and reports every registered format (values are not
asserted: machines are noisy). Its own checks make it fail where a format's generated output does not
parse into the call (or the reasoning) it was built with."""

from __future__ import annotations

from conftest import run_bench

from tokenmill.tokenizer_workers.output_parsers import REASONING_PARSERS, TOOL_PARSERS


def test_bench_parsers_quick_json_lists_every_format(tmp_path):
    report, stdout = run_bench(tmp_path, "parsers", "--quick", "--no-vllm", "--sizes", "200,800")
    assert report["tokens"] == [200, 800]
    assert report["versions"]["tokenmill"] and report["versions"]["vllm"] is None
    for kind, registry in (("tool", TOOL_PARSERS), ("reasoning", REASONING_PARSERS)):
        assert set(report[kind]) == set(registry), kind
        for name, row in report[kind].items():
            figures = row["tokenmill_us_per_token"]
            assert set(figures) == {"200", "800"}, (kind, name)
            assert all(isinstance(v, float) and v > 0 for v in figures.values()), (kind, name, figures)
    for name in TOOL_PARSERS:
        assert f"tool {name} " in stdout
