"""Bad flag values of `fulcrum serve` and `fulcrum bench serve` fail at start-up: one `error:`
line naming the flag, exit code 2, before any engine or server starts (never a traceback, never
a silently different value)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fulcrum.engine.arg_utils import _check_cpu_kv_memory, _physical_ram_bytes
from fulcrum.entrypoints.cli import build_parser, main
from fulcrum.entrypoints.openai.cli_serve import _load_template
from fulcrum.model.loader.tokenizer import check_tokenizer_path


@pytest.fixture(autouse=True)
def _no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check that let its value through would go on to start a real server: fail instead."""
    from fulcrum.entrypoints.openai import api_process, multi_api

    def started(*_: Any, **__: Any) -> int:
        raise AssertionError("the server started: the bad value was not caught")

    monkeypatch.setattr(api_process, "serve_api", started)
    monkeypatch.setattr(multi_api, "run_multi_api", started)


def _error_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run `fulcrum ARGV`, expect exit code 2; the error line it printed last."""
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"fulcrum {argv[0]}"), last
    assert ": error: " in last, last
    return last


# -- argparse-level values --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--port", "99999"], ["--port", "65535", "99999"]),
        (["--port", "-1"], ["--port", "-1"]),
        (["--served-model-name", ""], ["--served-model-name", "empty"]),
        (["--served-model-name", "m", "  "], ["--served-model-name", "empty"]),
        (["--max-request-bytes", "0"], ["--max-request-bytes", "1024"]),
        (["--shutdown-timeout", "-1"], ["--shutdown-timeout", "-1"]),
        (["--shutdown-timeout", "nan"], ["--shutdown-timeout"]),
    ],
)
def test_out_of_range_flag_is_named(
    capsys: pytest.CaptureFixture[str], flags: list[str], needles: list[str]
) -> None:
    last = _error_line(capsys, "serve", *flags)
    for needle in needles:
        assert needle in last, last


def test_edge_values_are_accepted() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "65535",
            "--max-request-bytes",
            "1024",
            "--shutdown-timeout",
            "0",
            "--served-model-name",
            "a",
            "b",
        ]
    )
    assert (args.port, args.max_request_bytes, args.shutdown_timeout) == (65535, 1024, 0.0)
    assert args.served_model_name == ["a", "b"]
    assert build_parser().parse_args(["serve", "--port", "0"]).port == 0


# -- --chat-template --------------------------------------------------------------------------


def test_missing_chat_template_file_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    last = _error_line(capsys, "serve", "--chat-template", "/nonexistent.jinja")
    assert last == "fulcrum serve: error: --chat-template: no such file '/nonexistent.jinja'"


def test_chat_template_directory_is_an_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    last = _error_line(capsys, "serve", "--chat-template", str(tmp_path))
    assert "--chat-template" in last and "directory" in last


def test_chat_template_syntax_error_fails_at_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    last = _error_line(capsys, "serve", "--chat-template", "{% if %}")
    assert "--chat-template: does not compile (line 1)" in last and "expression" in last
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }}\n")  # no endfor
    last = _error_line(capsys, "serve", "--chat-template", str(bad))
    assert "--chat-template: does not compile" in last and "endfor" in last


def test_good_chat_template_loads_from_text_or_file(tmp_path: Any) -> None:
    text = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert _load_template(text) == text
    path = tmp_path / "t.jinja"
    path.write_text(text)
    assert _load_template(str(path)) == text
    assert _load_template(None) is None


# -- engine values checked before the engine starts -------------------------------------------


def test_unknown_attention_backend(capsys: pytest.CaptureFixture[str]) -> None:
    last = _error_line(capsys, "serve", "--attention-backend", "bogus")
    assert "attention_backend" in last and "'bogus'" in last and "torch" in last


@pytest.mark.parametrize("path", ["/nonexistent", "./no-such-tokenizer", "../no-such-tokenizer"])
def test_missing_local_tokenizer_is_named(capsys: pytest.CaptureFixture[str], path: str) -> None:
    last = _error_line(capsys, "serve", "--tokenizer", path)
    assert last.endswith(f"tokenizer: no such directory {path!r}."), last
    assert "Repo id" not in last


def test_repo_ids_and_existing_paths_pass_the_tokenizer_check(tmp_path: Any) -> None:
    for name in (None, "HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path), "."):
        check_tokenizer_path(name)


def test_cpu_kv_cache_larger_than_ram(capsys: pytest.CaptureFixture[str]) -> None:
    if _physical_ram_bytes() is None:
        pytest.skip("this OS does not report its physical memory")
    last = _error_line(capsys, "serve", "--device", "cpu", "--kv-cache-memory", "100000")
    assert "kv_cache_memory: 100000 GiB" in last and "RAM" in last


def test_cpu_kv_cache_counts_every_rank() -> None:
    ram = _physical_ram_bytes()
    if ram is None:
        pytest.skip("this OS does not report its physical memory")
    gib = 0.75 * ram / 2**30
    _check_cpu_kv_memory(gib, 1)
    _check_cpu_kv_memory(None, 8)
    with pytest.raises(ValueError, match="kv_cache_memory: .* x 2 ranks"):
        _check_cpu_kv_memory(gib, 2)


# -- fulcrum bench serve ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "needle"), [("notjson", "Expecting value"), (json.dumps([1, 2]), "[1, 2]")]
)
def test_bench_extra_body_names_the_flag(
    capsys: pytest.CaptureFixture[str], body: str, needle: str
) -> None:
    # Port 9 (discard) is never contacted: the flag is checked before the first request.
    url = "http://127.0.0.1:9"
    last = _error_line(capsys, "bench", "serve", "--base-url", url, "--extra-body", body)
    assert last.startswith("fulcrum bench serve: error: --extra-body: not a JSON object: ")
    assert needle in last


def test_router_port_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    last = _error_line(capsys, "router", "--worker", "http://127.0.0.1:1", "--port", "70000")
    assert "--port" in last and "70000" in last, last
