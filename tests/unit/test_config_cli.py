"""Settings precedence (defaults < TOML file < environment < flags), profiles, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from contextsvc.cli import main
from contextsvc.config import Durability, Settings, load_settings, redacted_url
from contextsvc.core.profile import CompressionOverrides, ProfileOverrides, resolve_profile
from contextsvc.errors import InvalidArgument

TOML = """
listen = "127.0.0.1:6000"
fsync_batch_ms = 9
default_profile = "coder"

[profiles.coder]
model = "qwen3"
context_window = 65536
system_prompt = "You are careful."

[profiles.coder.compression]
keep_recent = 6
"""


def test_defaults_are_the_designs_numbers() -> None:
    s = Settings()
    assert s.listen == "127.0.0.1:50051" and s.store == "files:./.contextsvc"
    assert s.durability is Durability.FSYNC
    p = s.profiles["default"]
    assert (p.context_window, p.output_reserve_tokens, p.message_token_budget) == (32768, 2048, 0)
    c = p.compression
    assert (c.threshold, c.target, c.keep_recent, c.summary_max_tokens) == (0.90, 0.65, 4, 6000)
    t = s.tokens
    assert (t.fallback_chars_per_token, t.calibration_window, t.calibration_min_spread) == (1.8, 8, 1.25)
    assert (t.calibration_min_slope, t.calibration_max_slope, t.truncation_ratio) == (0.25, 1.0, 0.70)
    assert t.image_tokens_fallback == 1024
    z = s.summarizer
    assert (z.temperature, z.input_cap_chars, z.input_head_share, z.meta_summary_chars) == (0.3, 32_000, 0.75, 10_600)
    assert (z.critical_result_chars, z.result_preview_chars, z.args_preview_chars) == (4000, 800, 120)
    assert (z.image_budget_fraction, z.hard_truncate_fraction, z.memory_flush_soft_tokens) == (0.25, 0.5, 4000)
    assert s.llm_system_sources == ["task_note", "synapse_event"]
    assert s.limits.max_images_per_message == 8 and s.limits.max_image_bytes_per_append == 50 * 1024 * 1024


def test_file_then_environment_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(TOML)
    s = load_settings(cfg)
    assert s.listen == "127.0.0.1:6000" and s.fsync_batch_ms == 9
    assert s.profiles["coder"].compression.keep_recent == 6 and s.default_profile == "coder"
    monkeypatch.setenv("CONTEXTSVC_FSYNC_BATCH_MS", "7")
    monkeypatch.setenv("CONTEXTSVC_LISTEN", "127.0.0.1:7000")
    s = load_settings(cfg)
    assert (s.fsync_batch_ms, s.listen) == (7, "127.0.0.1:7000")
    s = load_settings(cfg, listen="127.0.0.1:8000", store="memory")
    assert (s.listen, s.store, s.fsync_batch_ms) == ("127.0.0.1:8000", "memory", 7)


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        Settings(listen="nohostport")
    bad = tmp_path / "bad.toml"
    bad.write_text("[profiles.x.compression]\nthreshold = 0.5\ntarget = 0.8\n")
    with pytest.raises(ValueError):
        load_settings(bad)
    with pytest.raises(ValueError, match="not found"):
        load_settings(tmp_path / "missing.toml")


def test_profile_resolution_merges_request_over_named_over_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(TOML)
    s = load_settings(cfg)
    p = resolve_profile(s, "", ProfileOverrides(context_window=4096, compression=CompressionOverrides(target=0.5)))
    assert (p.profile_id, p.model, p.context_window, p.system_prompt) == ("coder", "qwen3", 4096, "You are careful.")
    assert (p.compression.keep_recent, p.compression.target, p.compression.threshold) == (6, 0.5, 0.9)
    assert p.output_reserve == 1024  # 2048 capped at a quarter of the window
    assert p.per_message_budget == 4096 // 6
    with pytest.raises(InvalidArgument) as err:
        resolve_profile(s, "", ProfileOverrides(profile_id="nope"))
    assert err.value.violations[0].field == "profile.profile_id"


def test_cli_help_explains_each_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "contextsvc", "--help"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "serve" in out and "config" in out
    serve = subprocess.run(
        [sys.executable, "-m", "contextsvc", "serve", "--help"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    for flag in ("--listen", "--store", "--config", "--durability"):
        assert flag in serve


def _help(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    with pytest.raises(SystemExit):
        main([*words, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_cli_help_names_the_variables_and_what_insecure_allows(capsys: pytest.CaptureFixture[str]) -> None:
    """Each help text says what the command really reads: nested variables, the config variable,
    the store variable (maintain reads it like fsck), and everything the gateway's --insecure
    allows."""
    assert "CONTEXTSVC_<SECTION>__<NAME>" in _help(capsys)
    assert "CONTEXTSVC_CONFIG" in _help(capsys)
    assert "CONTEXTSVC_CONFIG" in _help(capsys, "serve")
    assert "env CONTEXTSVC_STORE" in _help(capsys, "maintain")
    assert "without --tls-cert/--tls-key" in _help(capsys, "gateway")


def test_cli_config_prints_effective_settings(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(TOML)
    assert main(["config", "--config", str(cfg)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["profiles"]["coder"]["context_window"] == 65536


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgres://app:s3cret@db:5432/ctx", "postgres://app:***@db:5432/ctx"),
        ("postgresql://u@h/d?sslmode=require&password=s3cret", "postgresql://u@h/d?sslmode=require&password=***"),
        ("postgres://app@db/ctx", "postgres://app@db/ctx"),
        ("postgres://app@db:5432?password=s3cret", "postgres://app@db:5432?password=***"),
        ("postgresql://u@h/d?sslpassword=s3cret&password=s3cret", "postgresql://u@h/d?sslpassword=***&password=***"),
        ("files:./.contextsvc", "files:./.contextsvc"),
        ("memory", "memory"),
    ],
)
def test_store_urls_are_shown_without_their_password(url: str, shown: str) -> None:
    assert redacted_url(url) == shown


def test_cli_config_hides_the_store_password(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONTEXTSVC_STORE", "postgres://app:s3cret@db:5432/ctx")
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["store"] == "postgres://app:***@db:5432/ctx" and "s3cret" not in out


def test_cli_rejects_invalid_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--listen", "bad"]) == 2
    assert "invalid settings" in capsys.readouterr().err


def test_a_nested_environment_variable_changes_one_field_of_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[limits]\nmax_page_size = 77\nmax_name_chars = 300\n[summarizer]\ntemperature = 0.5\n")
    monkeypatch.setenv("CONTEXTSVC_LIMITS__MAX_NAME_CHARS", "100")
    s = load_settings(cfg)
    assert (s.limits.max_page_size, s.limits.max_name_chars, s.summarizer.temperature) == (77, 100, 0.5)


PROFILE_FILE = """
[profiles.default]
context_window = 8192
system_prompt = "file"

[profiles.default.compression]
threshold = 0.5
target = 0.3
"""


def test_a_variable_for_one_profile_field_keeps_the_files_other_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "p.toml"
    cfg.write_text(PROFILE_FILE)
    monkeypatch.setenv("CONTEXTSVC_PROFILES__DEFAULT__SYSTEM_PROMPT", "env")
    p = load_settings(cfg).profiles["default"]
    assert (p.context_window, p.system_prompt, p.compression.threshold, p.compression.target) == (8192, "env", 0.5, 0.3)


def test_checks_across_fields_see_the_file_and_the_environment_merged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The variable alone (0.6 over the default target 0.65) would be refused; over the file's 0.3 it is valid.
    cfg = tmp_path / "p.toml"
    cfg.write_text(PROFILE_FILE)
    monkeypatch.setenv("CONTEXTSVC_PROFILES__DEFAULT__COMPRESSION__THRESHOLD", "0.6")
    c = load_settings(cfg).profiles["default"].compression
    assert (c.threshold, c.target) == (0.6, 0.3)


def _refused_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one stderr line of a command that refuses its settings (exit 2)."""
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("contextsvc: invalid settings: "), lines
    return lines[0]


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        (
            '[profiles.default.compression]\nsummarizer = "nosuch"\n',
            "profiles.default.compression.summarizer: unknown summarizer 'nosuch'; known: extractive, ollama, openai",
        ),
        (
            '[profiles.coder.compression]\nstrategies = ["summarize", "bogus"]\n',
            "profiles.coder.compression.strategies: unknown strategy 'bogus'; known: clear_tool_results, summarize",
        ),
        (
            'default_profile = "codr"\n[profiles.coder]\nmodel = "qwen3"\n',
            "default_profile 'codr' names no profile; configured: coder",
        ),
    ],
    ids=["summarizer", "strategies", "default_profile"],
)
def test_a_profiles_typo_is_refused_when_settings_load(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, toml: str, needle: str
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    with pytest.raises(ValueError):
        load_settings(cfg)
    assert needle in _refused_line(capsys, "config", "--config", str(cfg))


def test_the_built_in_default_profile_stays_beside_named_ones(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[profiles.coder]\nmodel = "qwen3"\n')
    s = load_settings(cfg)
    assert s.default_profile == "default" and sorted(s.profiles) == ["coder", "default"]


def test_log_levels_are_checked_when_settings_load(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Settings(log_level="debug").log_level == "DEBUG"  # any case, as before
    assert "log_level: must be one of" in _refused_line(capsys, "serve", "--store", "memory", "--log-level", "FOO")
    assert "got 'BAD'" in _refused_line(capsys, "gateway", "--log-level", "BAD")
    cfg = tmp_path / "c.toml"
    cfg.write_text('log_level = "verbose"\n')
    assert "got 'verbose'" in _refused_line(capsys, "tokens", "list", "--store", "memory", "--config", str(cfg))
    monkeypatch.setenv("CONTEXTSVC_LOG_LEVEL", "loud")
    assert "got 'loud'" in _refused_line(capsys, "config")


def test_cli_config_hides_passwords_in_every_url_setting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONTEXTSVC_SUMMARIZER__OPENAI__BASE_URL", "http://user:hunter2@127.0.0.1:56450")
    monkeypatch.setenv("CONTEXTSVC_SUMMARIZER__OLLAMA__BASE_URL", "http://user:hunter3@127.0.0.1:56451/x")
    monkeypatch.setenv("CONTEXTSVC_AUTH__TOKEN_STORE", "postgres://app:hunter4@db/ctx")
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    summarizer = json.loads(out)["summarizer"]
    assert summarizer["openai"]["base_url"] == "http://user:***@127.0.0.1:56450"
    assert summarizer["ollama"]["base_url"] == "http://user:***@127.0.0.1:56451/x"
    assert "hunter" not in out


def test_model_families_from_a_file_come_before_the_built_in_ones(tmp_path: Path) -> None:
    """docs/calibration.md maps one deployment name with a ``[tokens.model_families]`` table: that
    adds a glob (first, since the first match wins), it does not drop every built-in one (which
    priced gpt-4o, Claude and Llama 3 models by the ``default`` prior). A built-in glob named again
    takes the file's family."""
    from contextsvc.core.priors import DEFAULT_MODEL_FAMILIES, family_for

    path = tmp_path / "families.toml"
    path.write_text('[tokens.model_families]\n"my-gpt4o-deployment*" = "o200k"\n"claude*" = "default"\n')
    families = load_settings(str(path)).tokens.model_families
    assert list(families)[:2] == ["my-gpt4o-deployment*", "claude*"]
    assert family_for("my-gpt4o-deployment-eu", families) == "o200k"
    assert family_for("gpt-4o-mini", families) == "o200k"
    assert family_for("meta-llama-3-8b-instruct", families) == "llama3"
    assert family_for("claude-3-haiku", families) == "default"
    assert set(families) == set(DEFAULT_MODEL_FAMILIES) | {"my-gpt4o-deployment*"}


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        # gRPC's channel options and the collector's threshold are C ints: a traceback at start.
        ("CONTEXTSVC_LIMITS__GRPC_MAX_RECEIVE_BYTES", "99999999999999", "limits.grpc_max_receive_bytes"),
        ("CONTEXTSVC_HOT_PATH__GC_YOUNG_THRESHOLD", "99999999999999999999", "hot_path.gc_young_threshold"),
        # A deque's length: a traceback at start; the calibration's: INTERNAL on every append.
        ("CONTEXTSVC_EVENT_RETENTION", "99999999999999999999", "event_retention"),
        ("CONTEXTSVC_TOKENS__CALIBRATION_WINDOW", "99999999999999999999", "tokens.calibration_window"),
        # Past int64, the estimate's protobuf field: INTERNAL on every BuildContext.
        ("CONTEXTSVC_PROFILES__DEFAULT__CONTEXT_WINDOW", "99999999999999999999", "profiles.default.context_window"),
        # Infinite or NaN: taken where a bound is only from below, and "Infinity" in a JSON log line.
        ("CONTEXTSVC_SHUTDOWN_GRACE_SECONDS", "inf", "shutdown_grace_seconds"),
        ("CONTEXTSVC_FILES__CACHE_MB", "nan", "files.cache_mb"),
        # Contradicting each other: a request without a page size would get more than the maximum.
        ("CONTEXTSVC_LIMITS__DEFAULT_PAGE_SIZE", "5000", "default_page_size 5000 exceeds max_page_size 1000"),
        # Passed over in silence by pricing: the model priced by the default prior.
        ("CONTEXTSVC_TOKENS__MODEL_FAMILIES", '{"my-deployment*": "o200K"}', "tokens.model_families: 'my-deployment*'"),
        # Every summary of a profile naming it failed, and each compaction dropped turns instead.
        ("CONTEXTSVC_SUMMARIZER__OPENAI__BASE_URL", "127.0.0.1:8000", "summarizer.openai.base_url"),
        ("CONTEXTSVC_SUMMARIZER__OLLAMA__BASE_URL", "ftp://127.0.0.1", "summarizer.ollama.base_url"),
        ("CONTEXTSVC_SUMMARIZER__OPENAI__BASE_URL", "http://127.0.0.1:80a", "summarizer.openai.base_url"),
        # A burst without a rate: the bucket never refills, so it limited nothing, in silence.
        ("CONTEXTSVC_QUOTAS__CALLS_BURST", "20", "calls_burst needs calls_per_second"),
    ],
)
def test_numbers_no_part_of_the_service_can_take_are_one_line_naming_the_setting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, variable: str, value: str, named: str
) -> None:
    monkeypatch.setenv(variable, value)
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("contextsvc: invalid settings: ") and named in err and err.count("\n") == 1, err


def test_config_names_the_variables_it_ignores(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONTEXTSVC_LISTN", "0.0.0.0:1")  # misspelt: no setting, so ignored ...
    monkeypatch.setenv("CONTEXTSVC_TOKEN", "ctx_x")  # ... and the example clients' own variable
    assert main(["config"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["listen"] == "127.0.0.1:50051"
    assert err == "contextsvc: note: CONTEXTSVC_LISTN names no setting and is ignored\n"


def test_a_reader_that_leaves_early_is_no_traceback() -> None:
    """``contextsvc config | head -3``: the pipe closes under the printout."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "contextsvc", "config"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the settings are printed: the write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 1
    assert "Traceback" not in err, err


def test_a_maximum_page_size_lowered_alone_brings_the_default_down_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTEXTSVC_LIMITS__MAX_PAGE_SIZE", "20")
    assert (load_settings().limits.default_page_size, load_settings().limits.max_page_size) == (20, 20)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["serve", "--store", "memory", "--gateway", "127.0.0.1"], "gateway.listen: must be HOST:PORT"),
        (["gateway", "--listen", "127.0.0.1"], "gateway.listen: must be HOST:PORT"),
        (["gateway", "--target", "service"], "gateway.target: must be HOST:PORT"),
    ],
)
def test_a_bad_gateway_flag_names_the_gateway_setting(
    capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    """``serve --gateway 127.0.0.1`` was refused as ``listen: must be HOST:PORT``: the name of the
    server's own --listen, which the operator had given right."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("contextsvc: invalid settings: ") and named in err and err.count("\n") == 1, err


def test_gateway_flags_win_over_the_gateway_table_of_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONTEXTSVC_GATEWAY__TARGET", "127.0.0.1:1")
    monkeypatch.setenv("CONTEXTSVC_GATEWAY__LISTEN", "127.0.0.1:2")
    monkeypatch.setenv("CONTEXTSVC_GATEWAY__ALLOWED_HOSTS", '["proxy.internal"]')
    settings = load_settings(gateway={"target": "127.0.0.1:3"})
    assert (settings.gateway.target, settings.gateway.listen) == ("127.0.0.1:3", "127.0.0.1:2")
    assert settings.gateway.allowed_hosts == ["proxy.internal"]


def test_ctrl_c_on_a_command_is_no_traceback() -> None:
    """``tokens list`` waiting for a database that does not answer, interrupted with Ctrl-C: the
    shell's status for an interrupted command and one line, not a KeyboardInterrupt traceback."""
    import signal
    import socket
    import time

    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-m", "contextsvc", "tokens", "list", "--store", f"postgres://u@127.0.0.1:{port}/x"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        silent.settimeout(30)
        conn, _ = silent.accept()  # its connection waits for an answer that never comes
        with conn:
            time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err == "contextsvc: interrupted\n", err


@pytest.mark.parametrize("summarizer", ["openai", "ollama"])
def test_a_compaction_lock_timeout_shorter_than_a_summarizers_calls_is_refused(
    summarizer: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On PostgreSQL a compaction holds its session's lock while it waits for its summarizer (up to
    ``total_timeout_seconds``, 150 s by default); a lock wait shorter than that got a second
    replica's compaction of the session ABORTED while a working summarizer answered."""
    monkeypatch.setenv("CONTEXTSVC_STORE", "postgresql://app:pw@db.internal/contextsvc")
    monkeypatch.setenv("CONTEXTSVC_POSTGRES__COMPACTION_LOCK_TIMEOUT_SECONDS", "120")
    other = "ollama" if summarizer == "openai" else "openai"
    monkeypatch.setenv(f"CONTEXTSVC_SUMMARIZER__{other.upper()}__TOTAL_TIMEOUT_SECONDS", "60")
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("contextsvc: invalid settings: "), err
    assert "postgres.compaction_lock_timeout_seconds (120 s)" in err
    assert f"summarizer.{summarizer}.total_timeout_seconds (150 s)" in err
    # Lowered below the lock wait, it starts; so does any other store (its lock waits unbounded).
    monkeypatch.setenv(f"CONTEXTSVC_SUMMARIZER__{summarizer.upper()}__TOTAL_TIMEOUT_SECONDS", "100")
    assert main(["config"]) == 0
    monkeypatch.setenv(f"CONTEXTSVC_SUMMARIZER__{summarizer.upper()}__TOTAL_TIMEOUT_SECONDS", "300")
    monkeypatch.setenv("CONTEXTSVC_STORE", "memory")
    assert main(["config"]) == 0
