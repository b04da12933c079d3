"""``CONTEXTSVC_*`` variables into settings (``config.environment_values``): the rules the README
states (nested ``__``, JSON for tables and lists, arguments over variables), kept as they were
when pydantic-settings read them."""

from __future__ import annotations

import pytest

from contextsvc.config import Limits, Settings, environment_values


def test_nested_names_step_into_tables_and_dicts() -> None:
    env = {
        "CONTEXTSVC_LIMITS__MAX_PAGE_SIZE": "7",
        "CONTEXTSVC_SUMMARIZER__OPENAI__BASE_URL": "http://127.0.0.1:9/v1",
        "CONTEXTSVC_PROFILES__CODING__MODEL": "gpt-4o",
        "CONTEXTSVC_TOKENS__TOKENIZER_FILES__GPT-4O": "/t.json",
        "CONTEXTSVC_LISTEN": "127.0.0.1:7000",
    }
    assert environment_values(Settings, env) == {
        "limits": {"max_page_size": "7"},
        "summarizer": {"openai": {"base_url": "http://127.0.0.1:9/v1"}},
        "profiles": {"coding": {"model": "gpt-4o"}},
        "tokens": {"tokenizer_files": {"gpt-4o": "/t.json"}},
        "listen": "127.0.0.1:7000",
    }


def test_a_table_or_list_is_json_and_the_variables_inside_it_merge_into_it() -> None:
    env = {
        "CONTEXTSVC_LIMITS": '{"max_page_size": 5}',
        "CONTEXTSVC_LIMITS__MAX_MESSAGES_PER_APPEND": "3",
        "CONTEXTSVC_LLM_SYSTEM_SOURCES": '["a", "b"]',
    }
    values = environment_values(Settings, env)
    assert values == {
        "limits": {"max_page_size": 5, "max_messages_per_append": "3"},
        "llm_system_sources": ["a", "b"],
    }
    s = Settings.model_validate(values)
    assert (s.limits.max_page_size, s.limits.max_messages_per_append, s.llm_system_sources) == (5, 3, ["a", "b"])


def test_a_scalar_stays_text_even_when_it_looks_like_json() -> None:
    # A model named "123" is a string, not a number pydantic would refuse for a str field.
    assert environment_values(Settings, {"CONTEXTSVC_PROFILES__X__MODEL": "123"}) == {
        "profiles": {"x": {"model": "123"}}
    }


def test_names_are_case_insensitive_and_unknown_top_level_names_are_ignored() -> None:
    env = {"contextsvc_listen": "127.0.0.1:1", "CONTEXTSVC_NOT_A_SETTING": "x", "OTHER_LISTEN": "y"}
    assert environment_values(Settings, env) == {"listen": "127.0.0.1:1"}


def test_bad_json_and_unknown_nested_names_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="CONTEXTSVC_LIMITS: not valid JSON"):
        environment_values(Settings, {"CONTEXTSVC_LIMITS": "max_page_size=5"})
    monkeypatch.setenv("CONTEXTSVC_LIMITS__NO_SUCH_LIMIT", "1")
    with pytest.raises(ValueError, match="no_such_limit"):
        Settings()


def test_arguments_win_over_variables_field_by_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTEXTSVC_LIMITS__MAX_PAGE_SIZE", "9")
    monkeypatch.setenv("CONTEXTSVC_LIMITS__MAX_NAME_CHARS", "100")
    monkeypatch.setenv("CONTEXTSVC_FSYNC_BATCH_MS", "7")
    s = Settings(limits={"max_page_size": 4}, fsync_batch_ms=8)
    assert (s.limits.max_page_size, s.limits.max_name_chars, s.fsync_batch_ms) == (4, 100, 8)
    # A whole table given as an object replaces the variables' table, as before.
    s = Settings(limits=Limits(max_page_size=3))
    assert (s.limits.max_page_size, s.limits.max_name_chars) == (3, Limits().max_name_chars)
    # Fields set by a variable count as set (``load_settings`` merges them over a config file).
    assert "limits" in Settings().model_fields_set and Settings().limits.max_page_size == 9


def test_building_settings_reads_the_environment_and_a_copy_keeps_what_it_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CONTEXTSVC_FSYNC_BATCH_MS", "7")
    assert Settings().fsync_batch_ms == 7
    assert Settings.model_validate({}).fsync_batch_ms == 7  # validation goes through the constructor
    copied = Settings().model_copy(update={"listen": "127.0.0.1:1"})
    monkeypatch.setenv("CONTEXTSVC_FSYNC_BATCH_MS", "8")
    assert copied.fsync_batch_ms == 7
