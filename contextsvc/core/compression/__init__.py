"""Compression core (DESIGN §5.4): pure planning, the cheap stage, summarizer input, appended rows.

The engine commits compactions (retry, hard-truncate fallback, loop guard, events, triggers) and
calls these functions; nothing here does I/O.
"""

from contextsvc.core.compression.cheap import (
    ClearedToolResults,
    clear_old_tool_results,
    clearable_results,
    is_placeholder,
    placeholder_for,
)
from contextsvc.core.compression.formatting import (
    DEFAULT_SUMMARY_PROMPT,
    META_SUMMARY_PROMPT,
    SummaryInput,
    format_for_summary,
    format_meta_summary_input,
    is_refusal,
    needs_meta_summary,
    split_keys,
    summary_instructions,
    summary_parts,
    unfence,
)
from contextsvc.core.compression.plan import (
    CompactionPlan,
    PlanMode,
    mid_turn_keep_messages,
    plan_compaction,
    plan_hard_truncate,
)
from contextsvc.core.compression.records import (
    BREADCRUMBS_KEY,
    DEMOTED_RANGES_KEY,
    compression_record,
    covered_range,
    demoted_ranges,
    summary_anchor,
    summary_message,
)

__all__ = [
    "BREADCRUMBS_KEY",
    "DEFAULT_SUMMARY_PROMPT",
    "DEMOTED_RANGES_KEY",
    "META_SUMMARY_PROMPT",
    "ClearedToolResults",
    "CompactionPlan",
    "PlanMode",
    "SummaryInput",
    "clear_old_tool_results",
    "clearable_results",
    "compression_record",
    "covered_range",
    "demoted_ranges",
    "format_for_summary",
    "format_meta_summary_input",
    "is_placeholder",
    "is_refusal",
    "mid_turn_keep_messages",
    "needs_meta_summary",
    "placeholder_for",
    "plan_compaction",
    "plan_hard_truncate",
    "split_keys",
    "summary_anchor",
    "summary_instructions",
    "summary_message",
    "summary_parts",
    "unfence",
]
