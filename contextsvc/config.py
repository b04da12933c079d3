"""Every number of the service, in one settings object.

Values come from, lowest to highest precedence: the defaults below, a TOML config file
(``CONTEXTSVC_CONFIG`` or ``--config``), ``CONTEXTSVC_*`` environment variables, CLI flags.
Fields marked "per profile" may be overridden by a named profile or a request's inline profile.

Start-up cost (issue #9): building these classes is most of what importing this module costs, so
annotations here are real objects, not strings (no ``from __future__ import annotations``):
pydantic would otherwise evaluate each of the ~200 field annotations from its text. Default
factories are lambdas, not classes or builtins: pydantic inspects each factory's signature, and
that of a class or a builtin (``list``, ``dict``) is built from text (``tokenize``), a lambda's is not.
"""

import json
import logging
import os
import re
import types
import typing
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from contextsvc.core.priors import DEFAULT_MODEL_FAMILIES, PRIORS

MB = 1024 * 1024
#: the largest whole number any setting takes. Numbers end up in C (gRPC's channel options, the
#: collector's thresholds, deques' lengths) and in protobuf fields; past this a start failed with
#: a traceback deep in one of them, or every call with INTERNAL. No setting needs more.
MAX_SETTING_INT = 2**31 - 1


class _Section(BaseModel):
    """Every settings table: unknown keys refused, no infinite or NaN number (``inf`` would be
    accepted where a bound is only from below, and shows as ``Infinity`` in a JSON log line), and
    no whole number past ``MAX_SETTING_INT``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _int_in_range(cls, value: Any) -> Any:
        if type(value) is int and not -MAX_SETTING_INT <= value <= MAX_SETTING_INT:
            raise ValueError(f"must be at most {MAX_SETTING_INT}, got {value}")
        return value


class Durability(StrEnum):
    """When the files store forces appended records to disk."""

    #: fsync before every append is acknowledged: an acknowledged message survives a crash.
    FSYNC = "fsync"
    #: fsync at most every ``fsync_batch_ms``: a crash (of the machine, not only the process)
    #: may lose appends acknowledged within that last interval.
    BATCH = "batch"


#: Compaction strategies a profile may list, tried in the profile's order (DESIGN §5.4); the
#: engine's compaction (engine/compaction.py) runs them.
COMPACTION_STRATEGIES = ("clear_tool_results", "summarize")


class CompressionDefaults(_Section):
    """Compression knobs; each is overridable per profile."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    threshold: float = Field(0.90, gt=0, le=1)
    target: float = Field(0.65, gt=0, le=1)
    keep_recent: int = Field(4, ge=1)
    summary_max_tokens: int = Field(6000, ge=64)
    summary_prompt: str = ""
    summarizer: str = "extractive"
    strategies: list[str] = Field(default_factory=lambda: list(COMPACTION_STRATEGIES))
    critical_tool_names: list[str] = Field(default_factory=lambda: [])
    #: whether hard truncation (oldest whole turns dropped, no summary) may follow when the listed
    #: strategies cannot reach the target. True keeps every turn under the window whatever the
    #: summarizer does; false makes a clearing-only profile commit what clearing achieved.
    hard_truncate_fallback: bool = True

    @model_validator(mode="after")
    def _target_below_threshold(self) -> Self:
        if self.target >= self.threshold:
            raise ValueError(f"compression target {self.target} must be below threshold {self.threshold}")
        return self


class RecallDefaults(_Section):
    """Recall into the view (docs/search-and-recall.md); each is overridable per profile.

    On a BuildContext with an incoming user message, up to ``max_excerpts`` excerpts of the
    session's compacted history that match the message are added to the view as ``is_recall``
    system records, within a token budget of ``min(max_tokens, window_fraction x window)`` and
    what the view has left under ``window - reserve``.
    """

    model_config = ConfigDict(extra="forbid")

    #: the per-profile switch.
    enabled: bool = True
    #: excerpts added per turn at most (0 = none).
    max_excerpts: int = Field(2, ge=0, le=16)
    #: tokens all excerpts of one view may take together.
    max_tokens: int = Field(1024, ge=0)
    #: ... and at most this share of the context window.
    window_fraction: float = Field(0.10, ge=0, le=0.5)
    #: the least share (0-1) of the message's search terms an excerpt must contain.
    min_score: float = Field(0.5, ge=0, le=1)
    #: ... and one of those terms must be distinctive: found in at most this share of the
    #: session's chunks (or in one chunk). Words the whole history shares recall nothing.
    distinctive_share: float = Field(0.05, gt=0, le=1)


class ProfileConfig(_Section):
    """A named server profile (from the config file's ``[profiles.NAME]`` tables)."""

    model_config = ConfigDict(extra="forbid")

    model: str = "default"
    context_window: int = Field(32768, ge=256)
    system_prompt: str = ""
    vision: bool = False
    output_reserve_tokens: int = Field(2048, ge=0)
    message_token_budget: int = Field(0, ge=0)
    compression: CompressionDefaults = Field(default_factory=lambda: CompressionDefaults())
    recall: RecallDefaults = Field(default_factory=lambda: RecallDefaults())


class SearchSettings(_Section):
    """The raw history index's chunks and recall's candidates (docs/search-and-recall.md)."""

    model_config = ConfigDict(extra="forbid")

    #: a demoted turn longer than this is cut into chunks of at most this many characters
    #: (core/chunking.py); 0 = one chunk per turn.
    chunk_max_chars: int = Field(800, ge=0)
    #: lines a window of a long message repeats from the previous window.
    chunk_overlap_lines: int = Field(1, ge=0)
    #: search hits recall considers per turn before its score and budget filters.
    recall_candidates: int = Field(8, ge=1, le=100)


class Limits(_Section):
    """Request limits; breaking one is INVALID_ARGUMENT with the field named."""

    model_config = ConfigDict(extra="forbid")

    max_content_chars: int = Field(4 * MB, ge=1)
    max_messages_per_append: int = Field(500, ge=1)
    max_images_per_message: int = Field(8, ge=0)
    max_image_bytes_per_append: int = Field(50 * MB, ge=1)
    max_metadata_bytes: int = Field(64 * 1024, ge=0)
    #: levels of nested objects/lists in a metadata value. The protobuf decoder refuses ~32 levels
    #: (a whole request), and a response nests metadata deeper than the request did: this keeps
    #: every stored value readable by every client.
    max_metadata_depth: int = Field(16, ge=1, le=24)
    max_tool_calls_per_message: int = Field(128, ge=0)
    max_name_chars: int = Field(512, ge=1)
    #: a model name is a cache key (calibration per model): bounded like any other name.
    max_model_chars: int = Field(200, ge=1)
    default_page_size: int = Field(50, ge=1)
    max_page_size: int = Field(1000, ge=1)
    #: a ListMessages page ends before the row that would take its text and metadata past this
    #: (it always holds one row), so a page of big messages fits gRPC's default 4 MiB receive limit
    #: and the server's send limit; the next page token carries on from there (AIP-158).
    max_page_bytes: int = Field(3 * MB, ge=64 * 1024)
    # Room for a call's 50 MB of images plus its text and framing (not for every field at its own
    # limit at once: a larger request is refused by gRPC itself, RESOURCE_EXHAUSTED).
    grpc_max_receive_bytes: int = Field(64 * MB, ge=MB)
    grpc_max_send_bytes: int = Field(64 * MB, ge=MB)

    @model_validator(mode="after")
    def _default_page_within_max(self) -> Self:
        # A request without a page size gets the default as it is: above the maximum it would be
        # a page no request could ask for. A maximum lowered alone brings the default down with it;
        # both given, the other way round, contradict each other.
        if self.default_page_size > self.max_page_size:
            if "default_page_size" in self.model_fields_set:
                raise ValueError(
                    f"default_page_size {self.default_page_size} exceeds max_page_size {self.max_page_size}"
                )
            self.default_page_size = self.max_page_size
        return self


class TokenSettings(_Section):
    """Token accounting numbers (DESIGN §5.3)."""

    model_config = ConfigDict(extra="forbid")

    #: characters per token the extractive summarizer assumes when it turns summary_max_tokens into
    #: a length of text (pessimistic, so a summary stays within its tokens). Not the cold estimate:
    #: without a calibration a view is priced by its model family's prior (core/priors.py).
    fallback_chars_per_token: float = Field(1.8, gt=0)
    #: newest usable baselines per model the fit reads.
    calibration_window: int = Field(8, ge=2)
    #: the first version's one-line fit (DESIGN §5.3: 1.25x spread, slope in [0.25, 1.0]). Still
    #: accepted, so older files and variables load, but not read: the current fit holds every ratio
    #: within 0.4x-2.5x of its prior instead (core/calibration.py).
    calibration_min_spread: float = Field(1.25, gt=1)
    calibration_min_slope: float = Field(0.25, gt=0)
    calibration_max_slope: float = Field(1.0, gt=0)
    truncation_ratio: float = Field(0.70, gt=0, le=1)
    #: share of the image pricing rule's price (DESIGN §5.3) a view's images add to the truncation
    #: floor: an honest count holds the view's images, priced by that rule, so a small view made
    #: mostly of images cut to half is caught though its text alone is no evidence. 0 leaves
    #: images out of the floor (for a provider whose image rule is far cheaper than ours).
    truncation_image_ratio: float = Field(0.70, ge=0, le=1)
    image_tokens_fallback: int = Field(1024, ge=1)
    #: tokens a provider's count of a view may hold beyond the view itself (tool definitions sent
    #: with it, the provider's own framing and instructions), above the most any vocabulary can
    #: make of the view (a token a byte of its text, four times the image pricing rule). A count
    #: past that ceiling cannot be the view's: RecordBaseline refuses it as INVALID_ARGUMENT
    #: rather than let one bad number anchor the session and price the model for every session.
    baseline_unseen_tokens: int = Field(131_072, ge=0)
    #: what a client sends beside each view (tool definitions, above all) is learned per session
    #: from its baselines: a count of a view that exceeds the view's price by more than
    #: ``beside_share`` of that price and at least ``beside_min_tokens`` holds that excess beside
    #: the view (no calibration misses by half: cold estimates are off by a third at worst). A view
    #: priced whole (a session's first, every one after a compaction) adds it, and the compaction
    #: counts it among the tokens it cannot drop; such counts teach the model's calibration
    #: nothing (their residuals made every view's margin several times its price, and an agent
    #: with 3,000 tokens of tools on an 8k window was compacted to one message every turn).
    beside_min_tokens: int = Field(256, ge=0)
    beside_share: float = Field(0.5, ge=0)
    view_image_budget_fraction: float = Field(0.8, gt=0, le=1)
    #: how long a replica trusts its cached calibration before re-reading the store's observations.
    calibration_refresh_seconds: float = Field(5.0, ge=0)
    #: how long a RecordBaseline waits after writing its observation, when other builds or
    #: baselines were served during its agent's turn and at least ``calibration_coalesce_sessions``
    #: other sessions recorded a baseline of the model within as long before it (many agents are
    #: recording), so that the model's baselines written meanwhile share one refit (the response
    #: still holds its own observation). The wait ends early once as many other sessions joined
    #: as had recorded within the window before it. Fewer agents, or baselines further apart,
    #: refit at once.
    #: 0 refits at once always (issue #15). With 50 agents of one model (the load suite's turn loop)
    #: 0.02 made 0.08-0.13 refits a turn, 0.05 makes 0.03 (a refit is ~1 ms of CPU, the largest
    #: step of a baseline). But the wait is latency every gathered agent pays: at 0.05 the agents
    #: fell into step (all parked, then all appending at once) and the server sat idle a fifth of
    #: the run; 0.03, with the early end, keeps it busy and gave more turns per health check in
    #: every interleaved round (bench/RESULTS.md, round 15). RecordBaseline's p99 stays under
    #: AppendMessages'.
    calibration_coalesce_seconds: float = Field(0.03, ge=0, le=1)
    #: the other sessions that must have recorded a baseline of the model within that window for a
    #: baseline to wait: with fewer agents a shared refit saves little and the wait shows in
    #: RecordBaseline's latency.
    calibration_coalesce_sessions: int = Field(3, ge=1)
    #: models whose calibration a replica keeps cached (least recently used ones are re-read).
    max_cached_models: int = Field(1024, ge=1)
    #: built views remembered per session for RecordBaseline.
    views_kept_per_session: int = Field(16, ge=1)
    #: model name -> path of a tokenizer.json for exact counting.
    tokenizer_files: dict[str, str] = Field(default_factory=lambda: {})
    #: model name glob -> vocabulary family whose cold prior prices it (core/priors.py); the first
    #: matching glob wins, an unknown model gets the ``default`` family. Globs given come before the
    #: built-in ones, which stay (see the validator below).
    model_families: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_MODEL_FAMILIES))
    #: an estimate's margin is never below this share of what it prices (DESIGN §5.3).
    margin_floor: float = Field(0.01, ge=0, le=1)
    #: how many baselines the cold margin counts for: with n baselines it adds cold x w / (w + n).
    #: (16 and the 0.995 quantile below: chosen on the fit split, bench/fidelity/run.py --tune-margin)
    margin_prior_weight: float = Field(16.0, ge=0)
    #: the quantile of recent out-of-sample residuals (how far each accepted baseline was above the
    #: estimate made for its view, relative to its ``margin_base``) the margin covers.
    margin_quantile: float = Field(0.995, gt=0, le=1)
    #: what a margin protects is at least this share of the view's text (``margin_base``): a
    #: baseline's residual is relative to max(tokens priced, share x view text), and a
    #: baseline-anchored view's margin covers that base, not only its delta. So a model whose
    #: counts miss by a share of the whole view does not turn a small delta's miss into a huge
    #: rate that a compaction then applies to a whole context (issue #14, round 8).
    margin_view_share: float = Field(0.25, ge=0, le=1)
    #: most rows a view records how it cut (``ports.ViewRecord.cuts``, carried into a baseline's
    #: anchor in the session's state, ~18 integers a row): a view cutting more records none, and an
    #: anchor of it prices every row as its count held it (the state stays small).
    anchor_cuts_max: int = Field(64, ge=0)

    @field_validator("model_families")
    @classmethod
    def _given_families_first(cls, given: dict[str, str]) -> dict[str, str]:
        """Globs from a file or a variable come first (the first match wins) and the built-in ones
        stay after them: mapping one deployment name must not drop every known model's family. A
        built-in glob named again takes the family given (``"claude*" = "default"`` unmaps it).
        A family no prior exists for is refused: pricing would pass its glob over in silence."""
        for glob, family in given.items():
            if family not in PRIORS:
                raise ValueError(f"{glob!r}: unknown family {family!r}; known: {', '.join(PRIORS)}")
        return {**given, **{glob: f for glob, f in DEFAULT_MODEL_FAMILIES.items() if glob not in given}}


def _http_base_url(value: str) -> str:
    """A summarizer's ``base_url``: ``http://`` or ``https://`` and a host. Anything else made every
    summary of a profile naming it fail (each compaction falling back to dropping turns), the
    server having started without a word."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises on a port that is no number or out of range
    except ValueError:
        parts = None
    if parts is None or parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL with a host, got {redacted_url(value)!r}")
    return value


class OpenAISummarizerConfig(_Section):
    """An OpenAI-compatible ``POST {base_url}/v1/chat/completions`` (OpenAI, vLLM, llama.cpp, LM Studio)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["openai"] = "openai"
    base_url: str = "http://127.0.0.1:8000"
    model: str = "default"
    #: sent as ``Authorization: Bearer …`` when set; a SecretStr so it never reaches a log line.
    api_key: SecretStr = SecretStr("")
    #: newer OpenAI models refuse ``max_tokens`` and want ``max_completion_tokens``.
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"
    #: send the request's images (as data URLs); only for vision-capable models.
    vision: bool = False
    #: one attempt's read/write budget; a summary of 6000 tokens from a local model takes a while.
    timeout_seconds: float = Field(60.0, gt=0)
    connect_timeout_seconds: float = Field(5.0, gt=0)
    #: the whole call, retries included: a pre-turn compression must not block a turn for minutes.
    total_timeout_seconds: float = Field(150.0, gt=0)
    #: extra attempts after a connect error, a timeout, a 5xx or a 429 (never after another 4xx or
    #: garbage); a pause lasts at least what the answer's ``Retry-After`` asks.
    max_retries: int = Field(2, ge=0, le=10)
    #: first pause between attempts; doubled each retry.
    retry_backoff_seconds: float = Field(0.5, ge=0, le=30)
    #: the longest answer body read; a longer one fails the call (read whole, an endless or
    #: runaway body was held in memory until a timeout). A summary of 6000 tokens is ~30 KB.
    max_answer_bytes: int = Field(8 * 1024 * 1024, ge=4096)

    _base_url = field_validator("base_url")(_http_base_url)


class OllamaSummarizerConfig(_Section):
    """Ollama's ``POST {base_url}/api/chat`` (``stream: false``, ``think: false``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["ollama"] = "ollama"
    base_url: str = "http://127.0.0.1:11434"
    model: str = "default"
    #: ``options.num_ctx``. Ollama silently drops the head of a prompt longer than its context
    #: (default a few thousand tokens), so the summarizer input (≤ 32,000 chars ≈ 18k tokens plus
    #: images plus the summary itself) needs room. 0 = leave the server's default.
    num_ctx: int = Field(32768, ge=0)
    vision: bool = False
    timeout_seconds: float = Field(60.0, gt=0)
    connect_timeout_seconds: float = Field(5.0, gt=0)
    total_timeout_seconds: float = Field(150.0, gt=0)
    max_retries: int = Field(2, ge=0, le=10)
    retry_backoff_seconds: float = Field(0.5, ge=0, le=30)
    max_answer_bytes: int = Field(8 * 1024 * 1024, ge=4096)

    _base_url = field_validator("base_url")(_http_base_url)


class ExtractiveSummarizerConfig(_Section):
    """The default summarizer: deterministic, no network (DESIGN §5.5)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["extractive"] = "extractive"
    #: one quoted user ask / assistant answer is cut to this many characters.
    quote_chars: int = Field(300, ge=40)
    #: newest final answers / decisions listed.
    max_outcomes: int = Field(8, ge=1)
    max_errors: int = Field(5, ge=0)
    max_files: int = Field(20, ge=0)
    max_commands: int = Field(10, ge=0)
    #: share of the summary budget an earlier summary being replaced may keep.
    carried_summary_share: float = Field(0.35, ge=0, le=1)
    #: fact lines carried forward (contextsvc/core/facts.py): at most this many, this share of
    #: the summary's character budget, each cut to ``fact_chars``.
    max_facts: int = Field(24, ge=0)
    fact_share: float = Field(0.5, ge=0, le=1)
    fact_chars: int = Field(200, ge=40)


class SummarizerSettings(_Section):
    """Summarizer numbers and endpoints (DESIGN §5.4, §5.5)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.3, ge=0, le=2)
    input_cap_chars: int = Field(32_000, ge=1000)
    input_head_share: float = Field(0.75, gt=0, lt=1)
    meta_summary_chars: int = Field(10_600, ge=1000)
    critical_result_chars: int = Field(4000, ge=100)
    result_preview_chars: int = Field(800, ge=50)
    args_preview_chars: int = Field(120, ge=10)
    image_budget_fraction: float = Field(0.25, gt=0, le=1)
    hard_truncate_fraction: float = Field(0.5, gt=0, lt=1)
    memory_flush_soft_tokens: int = Field(4000, ge=0)
    forced_min_shrink: float = Field(0.10, ge=0, lt=1)
    #: a summary may use at most this share of the window (and never more than summary_max_tokens):
    #: the planner keeps that much room so the summary itself cannot push the context past target.
    summary_window_fraction: float = Field(0.10, gt=0, le=0.5)
    #: a summary the summarizer made longer than this many times that room (it ignored the output
    #: cap it was sent; our token count and the model's differ by less) is cut to the room, its
    #: fact lines added back, rather than stored whole and cut in the middle by every later view.
    summary_overrun_factor: float = Field(1.25, ge=1)
    #: the rows a compaction keeps must leave at least this share of the window for the summary and
    #: the prompt, however large those are: the planner's budget never drops below it.
    min_kept_fraction: float = Field(0.05, gt=0, lt=1)
    #: SearchHistory results when the request gives no limit, and the most it may ask for.
    search_default_limit: int = Field(10, ge=1)
    search_max_limit: int = Field(100, ge=1)
    #: mid-turn compaction keeps max(midturn_min_messages, 2 * keep_recent) newest messages of the turn ...
    midturn_min_messages: int = Field(12, ge=1)
    #: ... and retries with this many when that left nothing older in the turn to summarize.
    midturn_retry_messages: int = Field(2, ge=1)
    #: a recent turn with no tool work and at most this many characters is filler: an important
    #: old turn may take its place in the kept part.
    filler_turn_chars: int = Field(200, ge=0)
    #: breadcrumbs kept per summary / history chunk (KEYS line plus extracted entities).
    breadcrumb_limit: int = Field(40, ge=1, le=1000)
    #: one breadcrumb is cut to this many characters.
    breadcrumb_max_chars: int = Field(120, ge=16)
    #: a message's text is scanned for breadcrumbs up to this many characters (head + tail), so a
    #: megabyte tool result does not make compression slow.
    breadcrumb_scan_chars: int = Field(20_000, ge=100)
    extractive: ExtractiveSummarizerConfig = Field(default_factory=lambda: ExtractiveSummarizerConfig())
    openai: OpenAISummarizerConfig = Field(default_factory=lambda: OpenAISummarizerConfig())
    ollama: OllamaSummarizerConfig = Field(default_factory=lambda: OllamaSummarizerConfig())
    #: honour HTTP(S)_PROXY / NO_PROXY for summarizer calls.
    http_trust_env: bool = True


#: The summarizers a profile may name: one per typed endpoint table of ``[summarizer]`` (each
#: has a ``type`` tag); summarizers/registry.py builds each of them.
SUMMARIZER_NAMES = tuple(
    sorted(
        name
        for name, field in SummarizerSettings.model_fields.items()
        if "type" in getattr(field.annotation, "model_fields", {})
    )
)


class MaintenanceSettings(_Section):
    """Store maintenance (DESIGN §5.7, ``core/maintenance.py``), run by ``serve`` on every store."""

    model_config = ConfigDict(extra="forbid")

    #: ``warn`` reports what would be removed (log lines); ``enforce`` removes it.
    mode: Literal["warn", "enforce"] = "warn"
    #: a session idle longer than this is removed (0 = never).
    prune_after_days: float = Field(30.0, ge=0)
    #: at most this many sessions (0 = no cap); the longest idle go first.
    max_sessions: int = Field(0, ge=0)
    #: the data directory's budget in MB (0 = none); over it, sessions go down to the high-water mark.
    disk_budget_mb: float = Field(0.0, ge=0)
    #: share of the budget to come down to once over it.
    high_water_fraction: float = Field(0.8, gt=0, le=1)
    #: how often ``serve`` runs it.
    interval_seconds: float = Field(3600.0, gt=0)
    #: PostgreSQL: rows beyond a session's newest this many move to the archive table (0 = never);
    #: archived rows stay readable by every RPC.
    archive_keep_messages: int = Field(2000, ge=0)


class PostgresSettings(_Section):
    """The PostgreSQL store and event bus (DESIGN §5.7, §5.8)."""

    model_config = ConfigDict(extra="forbid")

    pool_min_size: int = Field(1, ge=0)
    pool_max_size: int = Field(10, ge=1)
    connect_timeout_seconds: float = Field(5.0, gt=0)
    #: waiting for a free pooled connection longer than this is UNAVAILABLE.
    acquire_timeout_seconds: float = Field(10.0, gt=0)
    #: appends run on at most this many pooled connections, each kept while appends wait
    #: (``stores/postgres/lanes.py``: no acquire and release per append); capped by pool_max_size.
    #: Two suffice since appends waiting together commit together (``append_group_max``), and
    #: fewer lanes make fuller batches: less server CPU per append (bench/RESULTS.md, round 9).
    append_lanes: int = Field(2, ge=1)
    #: the other single statements of a turn (a build's context read and view save, a baseline's
    #: anchor, observation and refit read, every single-statement write) run on at most this many
    #: connections, each kept while such statements wait (no acquire and release per statement);
    #: capped by pool_max_size. Fewer lanes make fuller batches (the ``*_group_max`` below): two
    #: served ~15 % more PostgreSQL turns a second than four, but a baseline's statements then
    #: queued behind a compaction's, and RecordBaseline p99 went past 2x AppendMessages p99 in
    #: the compacting runs (bench/RESULTS.md, round 37).
    statement_lanes: int = Field(4, ge=1)
    #: views saved by builds that wait for a statement lane together are saved in one
    #: transaction and one round trip, at most this many (1 = each its own).
    view_group_max: int = Field(32, ge=1)
    #: builds' context reads that wait for a statement lane together are read in one statement
    #: and one round trip, at most this many (1 = each its own). With every read alone, the
    #: served turn loop's server spent ~11 % more CPU a turn and PostgreSQL ~7 % less, and the
    #: server is what bounds that loop on one machine (bench/RESULTS.md, round 38).
    read_group_max: int = Field(32, ge=1)
    #: baselines anchored with their observation and event (``anchor_baseline``) that wait for a
    #: statement lane together run in one transaction and one round trip, at most this many.
    anchor_group_max: int = Field(32, ge=1)
    #: appends publishing their event that wait for a lane together run in one transaction, at
    #: most this many (one commit and one WAL flush for all; 1 = each its own; ``lanes.Group``).
    append_group_max: int = Field(32, ge=1)
    #: server-side statement_timeout for every pooled connection (0 = none).
    statement_timeout_ms: int = Field(30_000, ge=0)
    #: contexts built lately, kept per replica so a build reads only the rows added since
    #: (``stores/postgres/context_cache.py``); least recently built sessions go first. 0 = none:
    #: every build reads its whole context.
    context_cache_mb: float = Field(64.0, ge=0)
    #: how long open() waits for another process's migrations (advisory lock).
    migration_lock_timeout_seconds: float = Field(60.0, gt=0)
    #: try ``CREATE EXTENSION pg_trgm`` and build trigram indexes for search; off = plain scans.
    trigram: bool = True
    #: NOTIFY channel of the event bus (payload: the event id only).
    event_channel: str = Field("contextsvc_events", pattern=r"^[a-z_][a-z0-9_]{0,62}$")
    #: events older than this are deleted (the StreamEvents resume window).
    event_retention_seconds: int = Field(7 * 24 * 3600, ge=60)
    #: at most this many newest events are kept.
    event_retention_count: int = Field(100_000, ge=10)
    event_prune_interval_seconds: float = Field(60.0, gt=0)
    #: the listening connection is checked and every subscriber re-polls this often, so a lost
    #: notification delays an event by at most this long.
    event_poll_seconds: float = Field(5.0, gt=0)
    #: rows fetched per subscriber query.
    event_batch: int = Field(500, ge=1)
    #: newest events a replica keeps in memory for its watchers: one fetch per notification serves
    #: every watcher of the replica; a watcher further behind (a resume) reads the table itself.
    event_fanout_events: int = Field(4096, ge=1)
    #: longest pause between reconnect attempts of the listening connection.
    reconnect_max_seconds: float = Field(5.0, gt=0)
    #: calibration observations kept per model (the fit reads only the newest few).
    calibration_keep: int = Field(256, ge=2)
    #: a baseline's observation written with its anchor (one statement) leaves the trim to
    #: ``calibration_keep`` for later: a replica trims once it wrote this many such observations.
    calibration_trim_every: int = Field(16, ge=1)
    #: longest wait for another replica's compaction of the same session (it may be calling a
    #: summarizer: keep this above ``summarizer.*.total_timeout_seconds``); then ABORTED. Also
    #: bounds the wait for a lock connection when this replica holds ``pool_max_size`` locks.
    compaction_lock_timeout_seconds: float = Field(180.0, gt=0)
    #: how often a replica looks for compactions announced (``compression_started``) and never
    #: closed, because the replica running them died or their closing event was lost, and closes
    #: each whose session's lock is free with ``compression_refused`` (reason failed).
    abandoned_compaction_check_seconds: float = Field(60.0, gt=0)
    #: a start younger than this is not looked at (its compaction may still be taking the lock).
    abandoned_compaction_after_seconds: float = Field(30.0, ge=0)

    @model_validator(mode="after")
    def _pool_bounds(self) -> Self:
        if self.pool_min_size > self.pool_max_size:
            raise ValueError(f"pool_min_size {self.pool_min_size} exceeds pool_max_size {self.pool_max_size}")
        return self


class QuotaSettings(_Section):
    """Per-user limits (the user is the caller's id, see api/auth.py). 0 switches a limit off; all
    are off by default. Counted per server process: N replicas allow up to N times as much."""

    model_config = ConfigDict(extra="forbid")

    #: ContextService calls per second per user (a token bucket) ...
    calls_per_second: float = Field(0.0, ge=0)
    #: ... with room for this many at once (0 = one second's worth, at least 1).
    calls_burst: int = Field(0, ge=0)
    #: request bytes of AppendMessages per user and minute (a bucket refilled continuously; one
    #: append larger than this is let through when the bucket is full, and paid back after).
    append_bytes_per_minute: int = Field(0, ge=0)
    #: sessions a user may own (checked by CreateSession and ForkSession).
    sessions_per_user: int = Field(0, ge=0)
    #: StreamEvents calls a user may have open at once.
    streams_per_user: int = Field(0, ge=0)
    #: users whose buckets are remembered (least recently seen ones are forgotten first).
    max_tracked_users: int = Field(100_000, ge=1)

    @model_validator(mode="after")
    def _burst_has_a_rate(self) -> Self:
        if self.calls_burst and not self.calls_per_second:
            # A burst of a bucket that never refills limits nothing: the operator meant a limit.
            raise ValueError("calls_burst needs calls_per_second (the rate its bucket refills at)")
        return self


class AuthMode(StrEnum):
    """Whether callers must present an API token (DESIGN §5.10)."""

    #: tokens required unless the server listens on loopback only (then every caller is the
    #: local admin ``anonymous``, as a single-user tool expects).
    AUTO = "auto"
    #: tokens always required, loopback included.
    TOKENS = "tokens"
    #: no tokens: every caller is the admin ``anonymous``. Off loopback only with ``insecure``.
    NONE = "none"


class AuthSettings(_Section):
    """API tokens (``contextsvc tokens …``) and how the server checks them."""

    model_config = ConfigDict(extra="forbid")

    mode: AuthMode = AuthMode.AUTO
    #: where tokens live: empty = in the session store (files: ``tokens.json`` in its data
    #: directory; postgres: the ``api_tokens`` table; memory: in the server process only), or a
    #: store URL of their own (``files:PATH``, ``postgres://…``), e.g. beside a memory store.
    token_store: str = ""
    #: a looked-up token is trusted this long before it is read again, so a revocation reaches a
    #: running server within this time (0 = read the store on every call).
    cache_seconds: float = Field(5.0, ge=0, le=3600)
    #: tokens (and unknown values) remembered by the cache at most.
    cache_entries: int = Field(10_000, ge=1)
    #: an open ``StreamEvents`` call checks its token again this often (and before an event once
    #: this long has passed), so a revoked or expired token's streams end with ``UNAUTHENTICATED``
    #: within this plus ``cache_seconds``, not at the client's next reconnect.
    stream_check_seconds: float = Field(5.0, gt=0, le=3600)
    #: ``last_used`` is written at most once per this interval per token, never on every call.
    last_used_interval_seconds: float = Field(60.0, ge=0)
    #: ``tokens create`` without ``--expires``: days until the token expires (0 = never).
    default_expiry_days: int = Field(0, ge=0, le=36_500)
    #: failed authentications (no token, an unknown, revoked or expired one) one peer address may
    #: make a minute (a bucket refilled continuously); past it, that peer's calls with a token this
    #: server has not accepted lately get RESOURCE_EXHAUSTED, without a token lookup or a log line,
    #: until the bucket refills. Tokens it accepted before keep working from there. 0 = no limit.
    failures_per_peer_per_minute: int = Field(60, ge=0)
    #: peer addresses whose failures are remembered (the least recently failing forgotten first).
    max_tracked_peers: int = Field(10_000, ge=1)


class FilesSettings(_Section):
    """The files store's memory bound, start-up index and log compaction (issue #9 item 3).
    Env: ``CONTEXTSVC_FILES__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    #: the one memory budget (MB, estimated) of everything held per session touched: the rows, the
    #: engine's memos and reused views of them, the API adapter's encoded messages
    #: (``hot_path.wire_cache_mb`` bounds those on its own too). Past it the least recently used
    #: session is dropped from all of them (its summary stays) and read from its log again when
    #: next used; the most recently used session stays even when it alone is larger (a long
    #: session is not read again at every call). 0 keeps only the sessions in use. 256 MB holds
    #: ~1,000 sessions of 100 chat rows (40 MB held ~160: bench/store/memory.py); the sessions'
    #: summaries are held beside it, whatever it is. Agents take their turns in a cycle, so once
    #: their sessions outgrow the budget the least recently used one is the next one needed and
    #: every turn reads a log again: 100 agents of ~220 rows (~48 MB) made each turn cost 4x on
    #: the old default of 40 (bench/RESULTS.md, round 17).
    cache_mb: float = Field(256.0, ge=0)
    #: past ``cache_mb``, before whole sessions go, the rows outside a session's context are let
    #: go, all but its newest this many (a display page of the latest messages stays in memory):
    #: a turn reads only the context and appends, so long compressed sessions keep serving turns
    #: from memory. A read of a row let go (older display pages, a search, a fork, a flag change)
    #: reads the session's log whole again, as for a session dropped.
    resident_tail_rows: int = Field(128, ge=0)
    #: how often (seconds) a changed start-up index (``index.jsonl``) is written while serving;
    #: it is also written at a clean stop. A log written after it is read again at the next start.
    index_interval_seconds: float = Field(30.0, gt=0)
    #: after a clean stop the index is taken without a look at each log (``stores/_seal.py``);
    #: once serving, the logs' keys are checked in the background this many per worker-thread call.
    verify_batch: int = Field(512, ge=1)
    #: ... starting once the server serves, or this many seconds after the open, whichever is first.
    verify_delay_seconds: float = Field(5.0, ge=0)
    #: a log is rewritten compactly (in the background) once it holds more flag/header/state/view
    #: records than max(compact_min_records, compact_records_per_row x its rows).
    compact_min_records: int = Field(256, ge=1)
    compact_records_per_row: float = Field(2.0, ge=0)
    #: when two or more logs wait for the disk at once (the batch flusher's pass; appends of
    #: several sessions in fsync durability, which share passes), one ``syncfs(2)`` of the data
    #: directory's filesystem instead of an fsync of each: one journal commit for all. Only on
    #: Linux 5.8 or later (where syncfs reports write errors; elsewhere each file is fsynced).
    #: It also writes back other programs' unsynced data on that filesystem: turn it off when
    #: the data directory shares one with heavy writers.
    sync_whole_filesystem: bool = True
    #: the calibration log is written again with only the newest observations of each model (the
    #: store keeps ``4 x tokens.calibration_window`` a model) once it holds this many times as many
    #: lines: each rewrite costs a JSON line per kept observation and two fsyncs, so a larger factor
    #: spreads it over more baselines, and a start reads a longer log (~80 KB a model at 8).
    calibration_log_factor: int = Field(8, ge=2, le=64)
    #: the most lines a minute that say a session's log or history index could not be read or
    #: written (a full or failing disk fails every write at once: one line per failed append
    #: buried the log); the next line written says how many were left out.
    error_log_per_minute: int = Field(20, ge=1)
    #: how long a view or anchor line (soft state, nothing acknowledged depends on it) may wait for
    #: the next line written to its session's log, with which it shares a write, before the flusher
    #: writes it alone. A killed process loses the soft lines of this last interval (the next
    #: BuildContext and RecordBaseline make them again); 0 writes them at the next flusher pass.
    soft_line_wait_ms: int = Field(1000, ge=0, le=60_000)
    #: fsync durability: when writers came while a sync pass ran and at least
    #: ``group_commit_min_logs`` logs were written within the last 0.1 s (many sessions writing at
    #: once), the next pass waits this long for more writers before it syncs, so one commit serves
    #: more appends. A lone writer never waits: the first pass after an idle spell starts at once.
    #: The wait is latency: a few agents taking turns back to back only wait longer for each turn.
    group_commit_wait_ms: float = Field(2.0, ge=0, le=1000)
    #: ... the logs (sessions, and the calibration log) written within the last 0.1 s for it.
    group_commit_min_logs: int = Field(8, ge=1)


class HotPathSettings(_Section):
    """Caches and bounds of the BuildContext hot path (issue #15). Env: ``CONTEXTSVC_HOT_PATH__<FIELD>``."""

    model_config = ConfigDict(extra="forbid")

    #: memory (MB) of the API adapter's LRU of encoded stored messages; 0 turns the cache off. With
    #: the files store its bytes also count under ``files.cache_mb``.
    wire_cache_mb: int = Field(64, ge=0)
    #: sessions whose last assembled view is kept for reuse by the next build (0 = off).
    view_cache_sessions: int = Field(1024, ge=0)
    #: longest a BuildContext that must compress waits for a compaction of its session (one already
    #: running, or the one it started: its summarizer call); past it the build answers with a
    #: hard-truncated view, and the compaction goes on and commits for the builds after it.
    build_wait_seconds: float = Field(2.0, ge=0)
    #: longest RecordBaseline waits for the session's compaction lock to apply its anchor; past it
    #: (a compaction is running its summarizer) it answers and the anchor applies after that
    #: compaction, or is dropped if the compaction committed (the view is then of an older cycle).
    baseline_wait_seconds: float = Field(0.1, ge=0)
    #: the post-turn check (memory flush, compaction) skips a session at once when this many times
    #: its recorded context size, plus its system prompt's characters, stays under the lowest level
    #: either could fire at: it is far from both, and reading and pricing its view again would only
    #: say so (a baseline's check, on every turn). 0 checks every session in full.
    post_turn_headroom: float = Field(2.0, ge=0)
    #: the ``serve`` process's cyclic garbage collector: net new container objects between two
    #: collections of its youngest generation (Python's default is 700). Stored rows and each
    #: session's last view live on, so at 700 a collection ran every ~10 turns of 50 agents and
    #: walked every view kept since (~4% of a turn's server CPU, with a ~50 ms full collection every
    #: few seconds); at 20,000 most of those views are gone by the time one runs, for at most that
    #: many objects of cyclic garbage held a little longer. 0 keeps Python's default.
    gc_young_threshold: int = Field(20_000, ge=0)
    #: the ``serve`` process hands the memory its C heap holds free back to the system this often
    #: (glibc's ``malloc_trim``; elsewhere nothing happens): without it the process keeps much of
    #: the peak of a burst of load (``contextsvc/heap_trim.py``). 0 = never.
    heap_trim_interval_seconds: float = Field(30.0, ge=0)


class GatewaySettings(_Section):
    """The WebSocket gateway for browsers and its inspector page (DESIGN §5.9; docs/websocket.md)."""

    model_config = ConfigDict(extra="forbid")

    #: HOST:PORT of the gateway; empty = no gateway (``serve --gateway`` / ``gateway --listen`` set it).
    listen: str = ""
    #: the ContextService the gateway calls (``gateway --target``; the bundled gateway uses its own port).
    target: str = "127.0.0.1:50051"
    #: a socket without a cookie token must send ``{"type":"auth"}`` within this long, or it is closed 4003.
    auth_timeout_seconds: float = Field(5.0, gt=0, le=120)
    #: cookie carrying the API token of a browser.
    cookie_name: str = Field("contextsvc_token", pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    #: accept ``?api_token=`` on the socket URL (DESIGN §5.9 lists it beside the cookie and the auth
    #: frame). The gateway never logs URLs, but proxies in front of it may: turn it off there.
    allow_query_token: bool = True
    #: on a loopback listener, the Host names besides loopback ones (localhost, 127.0.0.0/8, ::1)
    #: that the gateway answers, e.g. a reverse proxy's name; any other is refused 403. Otherwise a
    #: page of another site whose name it rebinds to 127.0.0.1 (DNS rebinding) would be same-origin
    #: with the gateway, and reach whatever the service shows every local caller.
    allowed_hosts: list[str] = Field(default_factory=lambda: [])
    #: largest client frame; bigger ones are closed 1009 by the WebSocket layer (base64 of 50 MB is ~67 MB).
    max_frame_bytes: int = Field(80 * MB, ge=1024)
    #: largest first message of a socket that has to send an auth frame (no cookie or query token,
    #: and the service refuses anonymous callers): it may only be ``{"type":"auth",...}``, and
    #: ``max_frame_bytes`` there let a few unauthenticated sockets hold hundreds of MB for the
    #: ``auth_timeout_seconds``. A bigger first message is closed 1009; later ones get ``max_frame_bytes``.
    auth_frame_bytes: int = Field(256 * 1024, ge=1024)
    #: images per ``message`` frame and their decoded total.
    max_images: int = Field(8, ge=0)
    max_image_bytes: int = Field(50 * MB, ge=1)
    #: file references per ``message`` frame.
    max_files: int = Field(32, ge=0)
    #: frames waiting for one socket; a browser that falls this far behind is closed 4008.
    send_queue_frames: int = Field(1024, ge=8)
    #: bytes of frames waiting for one socket; past it the socket is closed 4008 as well. Frames can
    #: be views of whole sessions, so a count of frames alone does not bound the gateway's memory.
    #: A frame that finds nothing waiting is always sent, whatever its size.
    send_queue_bytes: int = Field(64 * MB, ge=64 * 1024)
    #: client frames one socket may have in progress at once (waiting on the service); past it the
    #: gateway stops reading that socket until one is answered, so a client that floods frames is
    #: slowed down by TCP flow control instead of holding a call and its answer per frame.
    frames_in_flight: int = Field(16, ge=1)
    #: WebSocket keepalive pings (heartbeats); a peer that misses a pong for ping_timeout is closed 1011.
    ping_interval_seconds: float = Field(20.0, gt=0)
    ping_timeout_seconds: float = Field(20.0, gt=0)
    close_timeout_seconds: float = Field(5.0, gt=0)
    #: permessage-deflate. Off: frames are small JSON, and compressing each frame once per socket
    #: costs CPU on every fan-out and a zlib context per socket.
    compression: bool = False
    #: recent events of a session kept by the gateway for replay to reconnecting sockets.
    replay_buffer_events: int = Field(2000, ge=10)
    #: a session's upstream event stream stays open this long after its last socket leaves,
    #: so that a quick reconnect replays from memory.
    hub_linger_seconds: float = Field(60.0, ge=0)
    #: when replaying from the service, the backlog is over after this long without an event.
    replay_settle_seconds: float = Field(0.3, gt=0, le=10)
    #: a unary call to the service gives up after this long.
    upstream_timeout_seconds: float = Field(60.0, gt=0)
    #: an upstream event stream that broke is reopened (from the last event id) after this pause.
    upstream_retry_seconds: float = Field(1.0, gt=0)
    #: messages per buffer returned by a ``get_view`` frame (the newest ones).
    view_messages: int = Field(500, ge=1)
    #: sessions per ``/api/sessions`` page and chunks per ``search`` frame.
    list_page_size: int = Field(100, ge=1)
    search_limit: int = Field(10, ge=1)
    #: attempts per unary call to the service that fails with UNAVAILABLE (the Python client's
    #: retry rule: a call that is not idempotent is retried only when the service did not start it).
    upstream_max_attempts: int = Field(4, ge=1, le=20)

    # TLS to the service (docs/websocket.md "TLS"). The bundled gateway follows its server: TLS when
    # the server serves it, trusting target_ca or else the server's own certificate.
    #: call ``target`` over TLS (the standalone gateway; any target_* file or name below turns it on).
    target_tls: bool = False
    #: PEM bundle of the CAs trusted for the service's certificate; empty = the system roots.
    target_ca: str = ""
    #: the name expected in the service's certificate when it is not the target's host.
    target_server_name: str = ""
    #: certificate chain and key presented to a service that requires mutual TLS (both or neither).
    target_client_cert: str = ""
    target_client_key: str = ""
    #: certificate chain and key of the gateway's own listener: serve https:// and wss:// (both or
    #: neither). Empty on a bundled gateway whose server serves TLS: the server's pair is used.
    tls_cert: str = ""
    tls_key: str = ""

    @model_validator(mode="after")
    def _gateway_pairs(self) -> Self:
        if bool(self.target_client_cert) != bool(self.target_client_key):
            raise ValueError("gateway.target_client_cert and target_client_key go together: give both or neither")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("gateway.tls_cert and gateway.tls_key go together: give both or neither")
        return self

    @property
    def upstream_tls(self) -> bool:
        return bool(self.target_tls or self.target_ca or self.target_server_name or self.target_client_cert)

    @field_validator("listen", "target")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if value:
            host, sep, port = value.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ValueError(f"must be HOST:PORT, got {value!r}")
        return value


class Settings(_Section):
    """The one home of every setting. Env: ``CONTEXTSVC_<FIELD>``; nested: ``CONTEXTSVC_LIMITS__MAX_PAGE_SIZE``
    (``environment_values``), read when settings are built (the constructor, ``model_validate``),
    not by ``model_copy``."""

    model_config = ConfigDict(extra="forbid")

    def __init__(self, **values: Any) -> None:
        # The environment under the arguments, table by table: an argument wins over a variable.
        super().__init__(**_deep_merge(environment_values(type(self)), values))

    listen: str = "127.0.0.1:50051"
    store: str = "files:./.contextsvc"
    config: str = ""
    log_level: str = "INFO"

    durability: Durability = Durability.FSYNC
    fsync_batch_ms: int = Field(50, ge=1, le=10_000)
    shutdown_grace_seconds: float = Field(5.0, ge=0)
    #: after in-flight calls drained, the bound of each short wait that follows: watch streams
    #: ending, the quiet period below, the transport's close (health watchers, calls refused
    #: meanwhile), and the telemetry flush when the grace is spent.
    shutdown_close_seconds: float = Field(0.5, ge=0)
    #: ... and closes once no call arrived for this long (within ``shutdown_close_seconds``): a call
    #: on its way is refused with UNAVAILABLE, not cancelled by the transport's close.
    shutdown_quiet_seconds: float = Field(0.1, ge=0)
    #: log lines a minute about refused undecodable requests (the rest are counted, not written).
    refusal_log_per_minute: int = Field(10, ge=0)
    #: a store that does not answer at start: serve NOT_SERVING and retry, pausing at most this long.
    store_retry_max_seconds: float = Field(5.0, gt=0)
    #: ... and give up (one line naming the store and the last cause, exit 1) after this long; 0 =
    #: keep trying for ever. Long enough for a database starting beside the server (a fresh
    #: volume's initialisation, a crash recovery), short enough that a mistyped host or a
    #: database that never comes ends the start where an operator sees it (it retried for ever).
    store_start_timeout_seconds: float = Field(120.0, ge=0)
    #: how often the server probes its store (a write + fsync) for the health service.
    store_health_interval_seconds: float = Field(2.0, gt=0, le=3600)
    #: with tracing on, a store call at least this slow (ms) gets a ``store.<op>`` event of its own
    #: on its span; every call is counted in the span's ``contextsvc.store.<op>.*`` attributes.
    telemetry_slow_store_ms: float = Field(10.0, ge=0)

    default_profile: str = "default"
    profiles: dict[str, ProfileConfig] = Field(default_factory=lambda: {"default": ProfileConfig()})
    #: stored role=system records whose metadata.source lets them reach the model.
    llm_system_sources: list[str] = Field(default_factory=lambda: ["task_note", "synapse_event"])
    pinned_max_fraction: float = Field(0.25, gt=0, le=1)

    #: events kept in memory for StreamEvents resume (in-process bus).
    event_retention: int = Field(10_000, ge=10)
    #: listing previews are cut to this many characters.
    preview_chars: int = Field(160, ge=10)

    #: PEM certificate chain and private key: serve TLS (both or neither). Reread on SIGHUP.
    tls_cert: str = ""
    tls_key: str = ""
    #: PEM bundle of the CAs whose client certificates are accepted: mutual TLS (needs tls_cert).
    tls_client_ca: str = ""
    #: allow listening beyond loopback without TLS or without authentication.
    insecure: bool = False
    auth: AuthSettings = Field(default_factory=lambda: AuthSettings())

    limits: Limits = Field(default_factory=lambda: Limits())
    tokens: TokenSettings = Field(default_factory=lambda: TokenSettings())
    summarizer: SummarizerSettings = Field(default_factory=lambda: SummarizerSettings())
    postgres: PostgresSettings = Field(default_factory=lambda: PostgresSettings())
    quotas: QuotaSettings = Field(default_factory=lambda: QuotaSettings())
    maintenance: MaintenanceSettings = Field(default_factory=lambda: MaintenanceSettings())
    files: FilesSettings = Field(default_factory=lambda: FilesSettings())
    hot_path: HotPathSettings = Field(default_factory=lambda: HotPathSettings())
    gateway: GatewaySettings = Field(default_factory=lambda: GatewaySettings())
    search: SearchSettings = Field(default_factory=lambda: SearchSettings())

    @field_validator("listen")
    @classmethod
    def _listen_has_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"listen must be HOST:PORT, got {value!r}")
        return value

    @model_validator(mode="after")
    def _tls_pairs(self) -> Self:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        return self

    @field_validator("log_level")
    @classmethod
    def _known_log_level(cls, value: str) -> str:
        # The names ``logging`` takes, in any case (as setup_logging has always taken them).
        if value.upper() not in logging.getLevelNamesMapping():
            raise ValueError(f"must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL; got {value!r}")
        return value.upper()

    @model_validator(mode="after")
    def _default_profile_exists(self) -> Self:
        if self.default_profile in self.profiles:
            return self
        if self.default_profile != "default":  # a typo would otherwise serve an empty profile
            configured = ", ".join(sorted(self.profiles))
            raise ValueError(f"default_profile {self.default_profile!r} names no profile; configured: {configured}")
        self.profiles["default"] = ProfileConfig()  # the built-in one, beside the file's named profiles
        return self

    @model_validator(mode="after")
    def _profiles_name_known_parts(self) -> Self:
        """A profile's summarizer and strategies are checked at load: an operator's typo stops the
        start, rather than failing every client's build as a bad request."""
        for name, profile in self.profiles.items():
            compression = profile.compression
            if compression.summarizer not in SUMMARIZER_NAMES:
                raise ValueError(
                    f"profiles.{name}.compression.summarizer: unknown summarizer {compression.summarizer!r}; "
                    f"known: {', '.join(SUMMARIZER_NAMES)}"
                )
            unknown = [s for s in compression.strategies if s not in COMPACTION_STRATEGIES]
            if unknown:
                raise ValueError(
                    f"profiles.{name}.compression.strategies: unknown strategy {unknown[0]!r}; "
                    f"known: {', '.join(COMPACTION_STRATEGIES)}"
                )
        return self

    @model_validator(mode="after")
    def _lock_outlasts_summaries(self) -> Self:
        """On PostgreSQL a compaction holds its session's lock while it waits for its summarizer,
        up to that summarizer's ``total_timeout_seconds`` (its attempts, ``timeout_seconds x
        (max_retries + 1)`` plus pauses, stop there, and so do all the calls of one compaction:
        ``engine/compaction.py``). Another replica's compaction of the session waits at most
        ``postgres.compaction_lock_timeout_seconds``: shorter than that, a working summarizer's
        compaction gets the other ABORTED while it runs. Refused at load, naming both."""
        if not self.store.strip().startswith(("postgres://", "postgresql://")):
            return self  # the other stores' lock is in-process and waits without this bound
        lock = self.postgres.compaction_lock_timeout_seconds
        for name in SUMMARIZER_NAMES:
            endpoint = getattr(self.summarizer, name)
            total = getattr(endpoint, "total_timeout_seconds", None)
            if total is None or total < lock:
                continue
            attempts = endpoint.max_retries + 1
            raise ValueError(
                f"postgres.compaction_lock_timeout_seconds ({lock:g} s) must be longer than "
                f"summarizer.{name}.total_timeout_seconds ({total:g} s), the longest a compaction holds its "
                f"session's lock waiting for that summarizer (its {attempts} attempts of timeout_seconds "
                f"{endpoint.timeout_seconds:g} s end there): raise the one or lower the other"
            )
        return self

    def profile(self, profile_id: str) -> ProfileConfig | None:
        return self.profiles.get(profile_id or self.default_profile)


def redacted_url(url: str) -> str:
    """``url`` with the password of its user part replaced (``postgres://app:***@db/contextsvc``),
    for logs and printed settings: a store URL comes from a secret and its password must not
    reach a log line."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # The authority ends at the first "/", "?" or "#"; a password may hold none of them unencoded.
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:cut], rest[cut:]
    user, at, host = authority.rpartition("@")
    if at and ":" in user:
        authority = f"{user.split(':', 1)[0]}:***@{host}"
    # libpq also takes passwords as query parameters (password, sslpassword).
    tail = re.sub(r"(?i)([?&](?:ssl)?password=)[^&#]*", r"\1***", tail)
    return f"{scheme}://{authority}{tail}"


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build settings from defaults, an optional TOML file, the environment, and overrides.

    ``overrides`` (from CLI flags) win over everything; None values are ignored. The layers are
    merged as raw values, field by field (``CONTEXTSVC_PROFILES__DEFAULT__SYSTEM_PROMPT`` changes
    that one field of the file's profile, not the whole table), then validated once: a check
    across fields (a profile's target below its threshold) sees the merged values, not defaults.
    """
    flags = {k: v for k, v in overrides.items() if v is not None}
    env = environment_values(Settings)
    path = config_file or flags.get("config") or env.get("config") or ""
    values = _deep_merge(_deep_merge(_read_toml(Path(path)) if path else {}, env), flags)
    if path:
        values["config"] = str(path)
    return Settings(**values)


ENV_PREFIX = "CONTEXTSVC_"
#: separates the levels of a nested setting's variable name: ``CONTEXTSVC_LIMITS__MAX_PAGE_SIZE``.
ENV_NESTED = "__"


def environment_values(model: type[BaseModel], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings ``CONTEXTSVC_*`` variables give, as nested values for ``model``.

    Names are case-insensitive; ``__`` steps into a table (a nested settings class, or a dict
    such as ``profiles``). A value is a string, left to the field's own validation, except for
    a field holding a table or a list: its value is JSON, and the variables naming fields
    inside it are merged into it. A variable naming no top-level field is ignored (other
    programs' variables may share the prefix); one naming no field inside a table is an error
    of that table. Written here rather than taken from pydantic-settings, which cost a tenth
    of a server's start-up to import (issue #9)."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    plen = len(ENV_PREFIX)
    for name in sorted(environ):  # a table's own JSON first, then the variables inside it
        if name[:plen].upper() != ENV_PREFIX:
            continue
        path = name[plen:].lower().split(ENV_NESTED)
        if not all(path) or path[0] not in model.model_fields:
            continue
        complex_value = _is_table_or_list(_annotation_at(model, path))
        value: Any = environ[name]
        if complex_value:
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"environment variable {name}: not valid JSON: {value!r}") from None
        node = out
        for key in path[:-1]:
            inner = node.get(key)
            if not isinstance(inner, dict):
                inner = node[key] = {}
            node = inner
        last = path[-1]
        if isinstance(value, dict) and isinstance(node.get(last), dict):
            value = _deep_merge(node[last], value)
        node[last] = value
    return out


#: ``CONTEXTSVC_*`` variables that are no setting of the server but read by the example clients
#: (``clients/``): ``contextsvc config`` does not call them ignored.
CLIENT_VARIABLES = frozenset({"CONTEXTSVC_TOKEN", "CONTEXTSVC_CA_FILE"})


def ignored_environment_names(model: type[BaseModel], environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``CONTEXTSVC_*`` variables that name no top-level setting, which ``environment_values``
    leaves out (a misspelt ``CONTEXTSVC_LISTN``), the clients' own variables apart."""
    environ = os.environ if environ is None else environ
    plen = len(ENV_PREFIX)
    return sorted(
        name
        for name in environ
        if name[:plen].upper() == ENV_PREFIX
        and name.upper() not in CLIENT_VARIABLES
        and name[plen:].lower().split(ENV_NESTED)[0] not in model.model_fields
    )


def _annotation_at(model: type[BaseModel], path: list[str]) -> Any:
    """The annotation of the value ``path`` names under ``model`` (None when it names no field)."""
    annotation: Any = model
    for key in path:
        annotation = _unoptional(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(key)
            if field is None:
                return None
            annotation = field.annotation
        elif typing.get_origin(annotation) is dict:
            annotation = typing.get_args(annotation)[1]
        else:
            return None
    return annotation


def _unoptional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kept = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(kept) == 1:
            return kept[0]
    return annotation


def _is_table_or_list(annotation: Any) -> bool:
    annotation = _unoptional(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return typing.get_origin(annotation) in (dict, list, set, tuple, frozenset)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    import tomllib  # only with a config file: its import compiles its patterns (a start without one skips it)

    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ValueError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path} is not valid TOML: {exc}") from None
    except OSError as exc:  # a directory, no permission: one line, as for a missing file
        raise ValueError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
