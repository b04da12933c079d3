"""Fact lines carried through compression (DESIGN §5.5, issue 14 item 6)."""

from __future__ import annotations

import dataclasses

import pytest

from contextsvc.core.facts import FACTS_HEADER, carried_facts, fact_lines, facts_block, strip_facts
from contextsvc.core.messages import Flags, Message, Role
from contextsvc.ports import SummaryRequest
from contextsvc.summarizers.extractive import ExtractiveSummarizer

PLANTED = {
    "preference": ("I prefer tabs over spaces; never reformat my files.", "prefer tabs"),
    "host": ("The primary database is db-primary.internal.example.com now.", "db-primary.internal.example.com"),
    "file_line": ("The crash comes from src/api/handler.py:142 in the retry loop.", "src/api/handler.py:142"),
    "ticket": ("This is tracked as INC-4411 by the on-call team.", "INC-4411"),
    "person": ("Please loop in our colleague Zoë Müller before deploying.", "Zoë Müller"),
    "date": ("The release freeze starts on 2026-03-14 at noon.", "2026-03-14"),
    "region": ("Everything runs in region eu-west-1 for this customer.", "eu-west-1"),
    "cyrillic": ("Бюджет согласует Алексей Иванов.", "Алексей Иванов"),
}


def _filler(i: int) -> list[Message]:
    return [
        Message(Role.USER, f"ok, next step {i} please, keep going with the refactor"),
        Message(Role.ASSISTANT, f"done with step {i}; the tests pass and nothing else changed"),
    ]


def _conversation() -> list[Message]:
    rows: list[Message] = []
    for i, (text, _) in enumerate(PLANTED.values()):
        rows += [Message(Role.USER, text), *_filler(i)]
    rows.append(
        Message(
            Role.TOOL,
            "\n".join(f"row {k}: ok" for k in range(300)) + "\nvault path secret/data/prod/payments found\n",
            tool_call_id="c1",
            name="run_command",
        )
    )
    return [dataclasses.replace(m, sequence_number=i + 1) for i, m in enumerate(rows)]


def test_every_planted_fact_becomes_a_fact_line() -> None:
    facts = "\n".join(fact_lines(_conversation()))
    for kind, (_, needle) in PLANTED.items():
        assert needle in facts, kind
    assert "secret/data/prod/payments" in facts  # a fact inside a long tool output
    assert "next step" not in facts  # filler holds no anchor


def test_facts_are_deduplicated_and_bounded() -> None:
    rows = _conversation() * 3
    facts = fact_lines(rows, max_facts=5, max_chars=10_000)
    assert len(facts) == 5 and len(set(facts)) == 5
    assert sum(len(f) for f in fact_lines(rows, max_chars=300)) <= 300


def test_the_facts_section_round_trips() -> None:
    block = facts_block(["a fact with host x.example.com", "another at 2026-01-02"])
    text = "Summary of 3 earlier messages.\n" + block + "\nFirst request: hi"
    assert carried_facts(text) == ["a fact with host x.example.com", "another at 2026-01-02"]
    assert FACTS_HEADER not in strip_facts(text) and "First request: hi" in strip_facts(text)


async def test_folding_summaries_keeps_the_facts_and_never_stacks_headers() -> None:
    summarizer = ExtractiveSummarizer()
    rows = _conversation()
    summary_text = ""
    for round_ in range(6):  # six compactions, each folding the previous summary into the next
        batch = [dataclasses.replace(m, sequence_number=1000 * round_ + m.sequence_number) for m in _filler(round_) * 4]
        if round_ == 0:
            batch = rows + batch
        else:
            previous = Message(Role.USER, summary_text, flags=Flags(is_summary=True, is_display=False))
            batch = [previous, *batch]
        summary_text = summarizer.summarize_sync(
            SummaryRequest(messages=batch, text="", instructions="", max_tokens=1200, temperature=0.3)
        )
    for kind, (_, needle) in PLANTED.items():
        assert needle in summary_text, kind
    assert summary_text.count("Summary of ") == 1
    assert summary_text.count("Earlier summary:") <= 1
    assert summary_text.count(FACTS_HEADER) == 1


def _summary_with(facts: list[str]) -> Message:
    text = "Summary of 40 earlier messages.\n" + facts_block(facts) + "\nKEYS: x"
    return Message(Role.USER, text, flags=Flags(is_summary=True, is_display=False))


def test_a_corrected_fact_is_replaced_not_carried_stale() -> None:
    # The Facts budget is full of carried facts; a correction of one of them came in since. It
    # used to rank below every carried fact and never get in, so the summary went on stating the
    # old value as a fact, alone.
    carried = [f"Service {i} runs on node-{i}.db.example.com owned by ops-{i}." for i in range(23)]
    carried.append("The deploy target is cluster kappa-7.")
    rows = [
        _summary_with(carried),
        Message(Role.USER, "Correction: the deploy target is now cluster sigma-2, forget kappa-7."),
        Message(Role.ASSISTANT, "Understood."),
    ]
    facts = fact_lines(rows, max_facts=24, max_chars=10_000)
    assert "The deploy target is cluster kappa-7." not in facts
    assert any("sigma-2" in f for f in facts)
    # Room for both: still only the revision (the old value is not a fact any more).
    facts = fact_lines(rows, max_facts=40, max_chars=10_000)
    assert "The deploy target is cluster kappa-7." not in facts
    assert any("sigma-2" in f for f in facts)


@pytest.mark.parametrize(
    "correction",
    [
        "Correction: the deploy target is now cluster sigma-2.",
        "We switched the deploy target to cluster sigma-2.",
        "Deploy target changed to cluster sigma-2.",
        "Use cluster sigma-2 as the deploy target instead.",
        "The deploy target is cluster sigma-2 from now on.",
        "No, the deploy target should be cluster sigma-2.",
    ],
)
def test_a_correction_replaces_the_fact_however_it_is_phrased(correction: str) -> None:
    rows = [_summary_with(["The deploy target is cluster kappa-7."]), Message(Role.USER, correction)]
    facts = fact_lines(rows)
    assert "The deploy target is cluster kappa-7." not in facts
    assert any("sigma-2" in f for f in facts)


def test_a_revision_keeps_facts_it_is_not_about() -> None:
    rows = [
        _summary_with(["The deploy target is cluster kappa-7.", "Backups go to s3://vault-backups/daily at 02:00."]),
        Message(Role.USER, "Actually the staging cluster tau-4 stays as it is."),  # shares one word: "cluster"
        Message(Role.USER, "Correction: backups of the build cache are kept 3 days."),  # "backups" only
        Message(Role.USER, "Actually kappa-7 has 12 nodes, not 10."),  # shares only the anchor
    ]
    facts = fact_lines(rows)
    assert "The deploy target is cluster kappa-7." in facts
    assert any("s3://vault-backups/daily" in f for f in facts)


async def test_folding_summaries_never_carry_a_corrected_value_alone() -> None:
    summarizer = ExtractiveSummarizer()
    crowd = [Message(Role.USER, f"Service {i} runs on node-{i}.db.example.com owned by ops-{i}.") for i in range(30)]
    first = [Message(Role.USER, "The deploy target is cluster kappa-7, remember that."), *crowd]
    summary_text = ""
    for round_ in range(5):
        batch = [
            dataclasses.replace(m, sequence_number=1000 * round_ + i + 1) for i, m in enumerate(_filler(round_) * 4)
        ]
        if round_ == 0:
            batch = first + batch
        else:
            if round_ == 2:
                batch = [Message(Role.USER, "Correction: the deploy target is now cluster sigma-2."), *batch]
            batch = [Message(Role.USER, summary_text, flags=Flags(is_summary=True, is_display=False)), *batch]
        summary_text = summarizer.summarize_sync(
            SummaryRequest(messages=batch, text="", instructions="", max_tokens=1200, temperature=0.3)
        )
        if round_ >= 2:
            assert "cluster kappa-7, remember" not in summary_text, round_
    assert "sigma-2" in summary_text


def test_work_reported_on_a_fact_does_not_replace_it() -> None:
    """An assistant that reports its work on something a fact names ("updated", "actually") is not
    correcting the fact; nor is a user who mentions an update without a new value."""
    rows = [
        _summary_with(["The config file is /etc/app.yaml and the port is 8080."]),
        Message(Role.ASSISTANT, "I updated /etc/app.yaml to add logging; the app actually reloads it."),
        Message(Role.USER, "Please update the app docs for /etc/app.yaml too."),
    ]
    facts = fact_lines(rows)
    assert "The config file is /etc/app.yaml and the port is 8080." in facts


@pytest.mark.parametrize(
    ("fact", "later"),
    [
        # one shared path is not a shared subject, and an assistant's "is now" reports its work
        (
            "The service config lives in config/app.yaml on host web-01.",
            Message(Role.ASSISTANT, "Done: config/app.yaml is now formatted with two-space indents."),
        ),
        # a reminder is not a revision
        (
            "The database host is db-prod-3 on port 5432.",
            Message(Role.USER, "Don't forget to back up db-prod-3 before the migration."),
        ),
        # a new rule about another thing of the same service
        (
            "Always deploy the api service to sigma-2 first.",
            Message(Role.USER, "From now on, the api service logs go to /var/log/api."),
        ),
        (
            "The staging site is https://staging.example.com/api and the token expires 2026-12-31.",
            Message(Role.ASSISTANT, "The page at https://staging.example.com/api now uses the new layout."),
        ),
    ],
)
def test_a_line_that_only_mentions_what_a_fact_names_does_not_replace_it(fact: str, later: Message) -> None:
    facts = fact_lines([_summary_with([fact]), later])
    assert fact in facts
